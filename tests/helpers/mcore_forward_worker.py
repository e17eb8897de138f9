"""torchrun worker: load converted dist-checkpoints into GPTModel at several TP/PP and compare logits with HF.

Usage (from tests/distributed/test_convert.py)::

    torchrun --standalone --nproc_per_node N tests/helpers/mcore_forward_worker.py JOBS.json OUT_DIR

``JOBS.json`` is a list of ``{"name", "hf_dir", "mcore_dir", "tp", "pp"}``; every job
whose ``tp * pp`` divides the world size runs on all ranks (the rest of the world is
data parallel). Each last-stage rank writes ``OUT_DIR/rank<r>.json`` with, per job,
the max |megatron - HF| logit difference over the real vocabulary and the largest
|logit| in the padded vocabulary rows (which must be 0). Megatron imports and
``init_process_group`` stay under the ``__main__`` guard: dist-checkpointing may
spawn helper processes that re-import this file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BATCH, SEQ = 2, 12


def _run_job(job: dict, world_size: int) -> dict | None:
    import torch
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import AutoModelForCausalLM

    from megatron_rl.actor.compat import cpu_shim
    from megatron_rl.models import adapter_for_config, padded_vocab_size

    tp, pp = job["tp"], job["pp"]
    if world_size % (tp * pp):
        return None
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    with cpu_shim.cuda_to_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)

    cfg = json.loads((Path(job["hf_dir"]) / "config.json").read_text())
    adapter = adapter_for_config(cfg)
    vocab = cfg["vocab_size"]
    config = TransformerConfig(
        **adapter.transformer_config_kwargs(cfg),
        **cpu_shim.transformer_config_overrides(),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
    )
    with cpu_shim.cuda_to_cpu():  # tied embeddings with PP > 1 call .cuda() at construction
        model = GPTModel(
            config=config,
            transformer_layer_spec=adapter.layer_spec(cfg),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **adapter.gpt_model_kwargs(cfg, padded_vocab_size=padded_vocab_size(vocab, tp_size=tp)),
        )
    # raise_all: the checkpoint holds exactly the keys (tensors and _extra_state objects)
    # that the GPTModels of all ranks together ask for, nothing missing, nothing extra.
    state = dist_checkpointing.load(model.sharded_state_dict(), job["mcore_dir"], strict="raise_all")
    model.load_state_dict(state)
    model.eval()

    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)

    def forward_step(data_iterator, module):
        return module(next(data_iterator), positions, attention_mask=None), None

    with torch.no_grad(), cpu_shim.cuda_to_cpu():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=True,
        )
        if not ps.is_pipeline_last_stage():
            return None
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(outputs[0])  # [b, s, Vp]

    hf_model = AutoModelForCausalLM.from_pretrained(job["hf_dir"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    return {
        "name": job["name"],
        "tp": tp,
        "pp": pp,
        "max_abs_diff": float((logits[..., :vocab] - hf_logits).abs().max()),
        "max_abs_hf": float(hf_logits.abs().max()),
        "max_abs_padding": float(logits[..., vocab:].abs().max()) if logits.shape[-1] > vocab else 0.0,
        "padded_vocab": int(logits.shape[-1]),
    }


def main() -> None:
    import torch.distributed as dist

    jobs = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    dist.init_process_group("gloo")
    from megatron_rl.actor.compat import cpu_shim

    first, second = cpu_shim.apply(), cpu_shim.apply()
    results = {"shim_first_apply": first, "shim_second_apply": second, "jobs": []}
    for job in jobs:
        result = _run_job(job, dist.get_world_size())
        if result is not None:
            results["jobs"].append(result)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=2))
    from megatron_rl.actor.launch import destroy_process_groups

    destroy_process_groups()


if __name__ == "__main__":
    main()
