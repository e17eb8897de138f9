"""torchrun worker for tests/gpu/test_actor_te.py: the actor with the Transformer-Engine spec.

Usage::

    torchrun --standalone --nproc_per_node N tests/helpers/actor_te_worker.py SPEC.json OUT_DIR

``SPEC.json``: ``{"hf_dir", "work_dir", "tp"}``. Runs on CUDA only. Checks, written by
rank 0 to ``OUT_DIR/report.json``:

* bf16 with the TE spec: log-probs close to a float32 transformers forward, a train step
  that moves the weights, save -> load of model + optimizer (TE ``_extra_state`` included)
  with identical log-probs after reload, ``iter_hf_weights`` covering the HF state dict;
* FP8 (``hybrid``, delayed scaling) when the GPU supports it: a finite train step.

Every sequence is full length (L = 32, N = 8), so each micro-batch is [8, 32]: FP8 GEMMs
need token counts divisible by 16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

N, L = 8, 32


def run(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import initialize_parallel
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.trainer import TrainerConfig

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (N, L), generator=g)
    attn = torch.ones(N, L, dtype=torch.long)
    loss_mask = attn.clone()
    loss_mask[:, :8] = 0
    base = ActorBatch(input_ids=ids, attention_mask=attn)
    report: dict = {"device": torch.cuda.get_device_name()}

    def build(options: ModelOptions) -> MegatronActor:
        cfg = ActorSpec(
            architecture=spec["hf_dir"],
            parallel=ParallelConfig(num_actor_ranks=dist.get_world_size(), tensor_model_parallel_size=spec["tp"]),
            model=options,
            trainer=TrainerConfig(lr=1e-3, max_tokens_per_microbatch=N * L),
        )
        groups = initialize_parallel(tensor_model_parallel_size=spec["tp"], seed=cfg.trainer.seed)
        return MegatronActor(cfg, groups=groups)

    hf = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).cuda()
    with torch.no_grad():
        logits = hf(ids.cuda()).logits.double()
    ref = torch.zeros(N, L, dtype=torch.float64)
    ref[:, 1:] = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None].cuda()).squeeze(-1).cpu()

    actor = build(ModelOptions(dtype="bfloat16", use_te=True))
    report["spec"] = type(actor.model.decoder.layers[0].self_attention.linear_qkv).__name__
    actor.load_hf_weights(spec["hf_dir"])
    lp = actor.compute_logprobs(base)
    report["bf16_logp_vs_hf"] = float((lp.logp.double() - ref)[:, 1:].abs().max())
    batch = ActorBatch(
        input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=lp.logp, advantages=torch.randn(N, L, generator=g)
    )
    m = actor.train_step(batch)
    report["bf16_step"] = {k: m[k] for k in ("loss/total", "actor/grad_norm", "actor/step_skipped")}
    after = actor.compute_logprobs(base).logp
    report["bf16_logp_moved"] = float((after - lp.logp).abs().max())
    weights = dict(actor.iter_hf_weights())
    report["hf_names"] = sorted(weights)
    actor.save_checkpoint(Path(spec["work_dir"]) / "ckpt" / "step_1")
    fresh = build(ModelOptions(dtype="bfloat16", use_te=True))
    record = fresh.load_checkpoint(Path(spec["work_dir"]) / "ckpt")
    report["reload_loaded_optimizer"] = record["loaded_optimizer"]
    report["reload_logp_diff"] = float((fresh.compute_logprobs(base).logp - after).abs().max())

    major, _ = torch.cuda.get_device_capability()
    if major >= 9:  # FP8 tensor cores (Hopper and later)
        fp8 = build(ModelOptions(dtype="bfloat16", use_te=True, fp8="hybrid", fp8_recipe="delayed"))
        fp8.load_hf_weights(spec["hf_dir"])
        m = fp8.train_step(batch)
        report["fp8_step"] = {k: m[k] for k in ("loss/total", "actor/grad_norm", "actor/step_skipped")}
        # Forward-only passes leave delayed scaling frozen (actor.model.frozen_fp8_scaling):
        # two passes over the same batch after a train step give the same log-probs bit for bit.
        first, second = fp8.compute_logprobs(base).logp, fp8.compute_logprobs(base).logp
        report["fp8_repeat_logp_diff"] = float((first - second).abs().max())
    return report


def main() -> None:
    import torch.distributed as dist

    from megatron_rl.actor.launch import destroy_process_groups, init_process_group

    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group()
    report = run(spec)
    if dist.get_rank() == 0:
        (Path(sys.argv[2]) / "report.json").write_text(json.dumps(report, indent=2))
    destroy_process_groups()


if __name__ == "__main__":
    main()
