"""The Megatron actor's ranks as Ray actors, driven as one group by the trainer.

Every rank is a Ray actor process running one :class:`~megatron_rl.actor.actor.MegatronActor`.
The group is started in two phases: the workers are created, rank 0 reports its node's
address and a free port, then every rank joins the same ``torch.distributed`` group
(gloo on CPU, NCCL on GPU) and builds its model. Each call of the group runs the same
method on every rank (the actor's methods are collective) and returns rank 0's result.

With ``with_reference=True`` each rank also holds a frozen copy of the initial policy
for the KL term's reference log-probs. It is a second ``MegatronActor`` built from the
same config and seed (so the same initial weights); its optimizer is never stepped.
On GPUs that copy costs a second model's memory; offloading it is future work.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
import torch

from megatron_rl.actor.actor import ActorConfig, LogProbs
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.algo.config import AlgorithmConfig


@dataclass(kw_only=True)
class ActorGroupOptions:
    """How the actor ranks are placed."""

    num_ranks: int = 1
    """Actor processes (TP x PP x DP)."""

    num_cpus_per_rank: float = 0.0
    """Ray CPUs reserved per rank (0 lets ranks share cores with the rollout engines: the
    colocated placement on CPU)."""

    num_gpus_per_rank: float = 0.0
    """Ray GPUs per rank (1 on GPU clusters)."""

    torch_threads_per_rank: int = 1
    """torch intra-op threads per rank on CPU."""

    with_reference: bool = False
    """Also hold a frozen copy of the initial policy for reference log-probs (KL)."""

    scheduling_strategy: str = "DEFAULT"
    """Where Ray puts the ranks: ``DEFAULT`` (Ray's own choice) or ``SPREAD`` (contiguous
    blocks of ranks over the alive nodes, see
    :func:`megatron_rl.rollout.pool.scheduling_strategies`)."""


class ActorWorker:
    """One rank of the actor group (constructed by Ray; see :class:`ActorGroup`)."""

    def __init__(self, *, rank: int, world_size: int, torch_threads: int):
        self.rank = rank
        self.world_size = world_size
        if not torch.cuda.is_available():
            torch.set_num_threads(torch_threads)
        self.actor = None
        self.reference = None

    def node_id(self) -> str:
        """The Ray node this rank runs on (hex id)."""
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (asked of rank 0 for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, *, master_addr: str, master_port: int, config: ActorConfig, with_reference: bool) -> None:
        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.actor.launch import init_process_group, initialize_parallel

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each GPU worker its own CUDA_VISIBLE_DEVICES
        )
        init_process_group(rank=self.rank, world_size=self.world_size)
        groups = initialize_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            seed=config.seed,
        )
        self.actor = MegatronActor(config, groups=groups)
        if with_reference:
            self.reference = MegatronActor(config, groups=groups)

    def compute_logprobs(self, batch: ActorBatch, temperature: float, policy: str = "actor") -> LogProbs:
        model = self.reference if policy == "reference" else self.actor
        if model is None:
            raise RuntimeError(f"no {policy!r} model on this actor group (with_reference is off)")
        return model.compute_logprobs(batch, temperature)

    def train_step(self, batch: ActorBatch, algorithm: AlgorithmConfig, temperature: float, lopti_phase, norms: bool):
        metrics = self.actor.train_step(
            batch, algorithm, temperature=temperature, lopti_phase=lopti_phase, token_grad_norms=norms
        )
        return metrics, (self.actor.last_token_grad_norms if norms else None)

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None) -> str:
        return str(self.actor.save_checkpoint(directory, trainer_state=trainer_state))

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.actor.load_checkpoint(directory)

    def load_hf_weights(self, directory: str) -> int:
        count = self.actor.load_hf_weights(directory)
        if self.reference is not None:
            self.reference.load_hf_weights(directory)
        return count

    def put_weight_buckets(self, bucket_bytes: int) -> list[ray.ObjectRef] | None:
        """Gather full HF-named tensors (collective) and, on rank 0, ``ray.put`` them in
        buckets for the rollout engines; other ranks return ``None``."""
        from megatron_rl.rollout.weight_sync import bucket_named_tensors, make_bucket

        named = self.actor.iter_hf_weights(bucket_bytes=bucket_bytes)
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return None
        return [ray.put(make_bucket(tensors)) for tensors in bucket_named_tensors(named, bucket_bytes)]

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All HF-named tensors on rank 0 (for small models and tests); ``None`` elsewhere."""
        out = {name: t.clone() for name, t in self.actor.iter_hf_weights()}
        return out if self.rank == 0 else None


class ActorGroup:
    """``num_ranks`` :class:`ActorWorker` Ray actors forming one Megatron world."""

    def __init__(self, config: ActorConfig, options: ActorGroupOptions):
        self.options = options
        from megatron_rl.rollout.pool import scheduling_strategies

        placement = scheduling_strategies(
            options.scheduling_strategy,
            options.num_ranks,
            num_cpus=options.num_cpus_per_rank,
            num_gpus=options.num_gpus_per_rank,
        )
        self.workers = [
            ray.remote(ActorWorker)
            .options(
                num_cpus=options.num_cpus_per_rank,
                num_gpus=options.num_gpus_per_rank,
                max_restarts=0,
                scheduling_strategy=placement[r],
            )
            .remote(rank=r, world_size=options.num_ranks, torch_threads=options.torch_threads_per_rank)
            for r in range(options.num_ranks)
        ]
        addr, port = ray.get(self.workers[0].address.remote())
        self._all(
            "setup", master_addr=addr, master_port=port, config=config, with_reference=options.with_reference
        )

    def _all(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` on every rank (collective); rank 0's result."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return ray.get(refs)[0]

    def compute_logprobs(self, batch: ActorBatch, temperature: float, *, policy: str = "actor") -> LogProbs:
        return self._all("compute_logprobs", ray.put(batch), temperature, policy)

    def train_step(
        self, batch: ActorBatch, algorithm: AlgorithmConfig, *, temperature: float, lopti_phase=None,
        token_grad_norms: bool = False,
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """One optimizer step; ``(metrics, [N, L] per-token logit-gradient norms or None)``."""
        return self._all("train_step", ray.put(batch), algorithm, temperature, lopti_phase, token_grad_norms)

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None = None) -> str:
        return self._all("save_checkpoint", str(directory), trainer_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self._all("load_checkpoint", str(directory))

    def load_hf_weights(self, directory: str) -> int:
        return self._all("load_hf_weights", str(directory))

    def put_weight_buckets(self, bucket_bytes: int) -> list[ray.ObjectRef]:
        return self._all("put_weight_buckets", bucket_bytes)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state_dict")

    def node_ids(self) -> list[str]:
        """The Ray node id of every rank, in rank order."""
        return ray.get([w.node_id.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
