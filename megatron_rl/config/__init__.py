"""The typed run config: one keyword-only dataclass per YAML section, one module per section.

A run is described by :class:`~megatron_rl.config.run.RunConfig` (``model``, ``parallel``,
``rollout``, ``algorithm``, ``trainer``, ``actor``, ``data``, ``logging``). Read one with
:func:`~megatron_rl.config.run.load_run_config` (YAML plus dotted ``section.field=value``
overrides). The generic machinery (type checks, "did you mean" errors, renamed fields,
registries, saving the resolved config) is the sub-package :mod:`megatron_rl.config.lib`,
the lowest layer of the package: everything may import it, it imports nothing of
megatron_rl. :mod:`megatron_rl.config.seeding` derives every seed of a run from
``trainer.seed``.

Modules: ``data`` (``data``, ``logging``), ``model``, ``parallel``, ``rollout``,
``trainer`` (``trainer``, ``actor``), ``run`` (``RunConfig``, loading, the field
reference); the ``algorithm`` section is the loss library's own
(:class:`~megatron_rl.algo.config.AlgorithmConfig`). This ``__init__`` imports nothing, so
the machinery is importable below ``algo`` (which the ``run`` module composes).

Conventions (``docs/style.md``): a docstring under every field (``docs/config.md`` is
generated from them), units and scope in names, checks of one section in its
``__post_init__`` with the path relative to the section, checks that span sections in
``RunConfig.__post_init__`` with the full path, and a ``ConfigWarning`` rather than an
error when a setting is legal but ignored. Each setting is declared once: where two
components need the same settings, one class declares them and the other extends it
(``TrainerConfig`` extends ``OptimConfig``, ``ModelConfig`` extends ``ModelOptions``,
``RolloutConfig`` and the engines' ``SamplingParams`` extend ``SamplingSettings``), and
components receive the sections themselves, never copies. Engine settings are not
re-declared: ``rollout.engine_args`` is handed to the engine unchanged.

Only the builder (:mod:`megatron_rl.loop.builder`) reads a whole ``RunConfig``;
components get the sections they need. ``python -m megatron_rl.config`` prints the field
reference (``docs/config.md``).
"""
