"""Actor groups a test module shares: one per rank count, rebuilt for each spec.

Starting an actor rank costs seconds of imports (megatron-core, transformers) in a new Ray
actor process; a module that builds many groups of the same size (one per case and
setting) starts each size's ranks once and :meth:`ActorGroup.rebuild` s them for the next
spec. tests/distributed/test_old_logp_source.py checks that a rebuilt group computes what a
new one does.
"""

from __future__ import annotations

from megatron_rl.actor.group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.cluster.placement import GroupPlacement


class ActorGroups:
    """The module's groups by rank count; each rank takes ``num_cpus`` of Ray's CPUs."""

    def __init__(self, *, num_cpus: float = 0):
        self.num_cpus = num_cpus
        self._groups: dict[int, ActorGroup] = {}

    def get(self, spec: ActorSpec) -> ActorGroup:
        """A group built from ``spec``: the kept one of its size rebuilt, or a new one (the
        first of its size, or after a failure left the kept one unusable)."""
        n = spec.parallel.num_actor_ranks
        group = self._groups.pop(n, None)
        if group is not None:
            try:
                group.rebuild(spec)
            except Exception:  # a failed test's group (its ranks mid-call, or dead): start anew
                group.shutdown()
                group = None
        if group is None:
            group = ActorGroup(spec, GroupPlacement.uniform(n, num_cpus=self.num_cpus))
        self._groups[n] = group
        return group

    def shutdown(self) -> None:
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()
