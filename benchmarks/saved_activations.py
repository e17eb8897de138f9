#!/usr/bin/env python
"""Bytes a transformer layer saves for the backward pass, measured, against the planner.

Builds the Megatron actor (local spec, fp32, one rank on gloo) at 2 and 4 layers for each
shape, runs one train step with ``torch.autograd.graph.saved_tensors_hooks`` recording the
storage of every tensor autograd saves (parameters excluded; a view counts its whole
storage, which is what stays alive), and prints per shape the bytes per token and layer
(the 4-layer total less the 2-layer one, over 2 layers) next to
``megatron_rl.cluster.planner.activation_bytes_per_token_layer``. The planner's formula was
fitted to these numbers (``megatron_rl/cluster/planner.py``).

    python benchmarks/saved_activations.py          # one JSON line per shape
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SHAPES = [  # hidden, ffn, heads, kv_heads, seq_len, seqs (1,024 tokens each)
    dict(hidden=1024, ffn=2816, heads=16, kv_heads=4, seq_len=256, seqs=4),
    dict(hidden=1024, ffn=1408, heads=16, kv_heads=4, seq_len=256, seqs=4),
    dict(hidden=1024, ffn=2816, heads=8, kv_heads=2, seq_len=256, seqs=4),
    dict(hidden=512, ffn=2816, heads=8, kv_heads=2, seq_len=256, seqs=4),
    dict(hidden=1024, ffn=2816, heads=16, kv_heads=4, seq_len=128, seqs=8),
]
MOE_SHAPES = [  # mixture-of-experts layers (Qwen3-MoE): experts, their width, experts per token
    dict(hidden=1024, ffn=2816, heads=16, kv_heads=4, seq_len=256, seqs=4, experts=8, expert_ffn=512, topk=2),
    dict(hidden=1024, ffn=2816, heads=16, kv_heads=4, seq_len=256, seqs=4, experts=16, expert_ffn=256, topk=4),
    dict(hidden=512, ffn=2816, heads=8, kv_heads=2, seq_len=256, seqs=4, experts=8, expert_ffn=768, topk=2),
]


def saved_bytes(case: dict, groups) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one train step."""
    import actor_memory
    import torch

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch

    actor = MegatronActor(actor_memory.spec_of(case, 1), groups=groups)
    params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case["vocab"], (case["seqs"], case["seq_len"]), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, :16] = 0
    old = actor.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask)).logp
    adv = torch.randn(case["seqs"], 1, generator=g).expand_as(old).clone()
    batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old, advantages=adv)
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.train_step(batch)
    return sum(seen.values())


def main() -> int:
    import actor_memory

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)
    import torch

    from megatron_rl.actor.launch import destroy_process_groups, init_process_group, initialize_parallel
    from megatron_rl.cluster.planner import Architecture, activation_bytes_per_token_layer

    init_process_group()
    torch.set_num_threads(1)
    groups = initialize_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    for shape in SHAPES + MOE_SHAPES:
        case = {**actor_memory.DEFAULT_CASE, "vocab": 32000, "loss_impl": "fused_linear", **shape}
        two, four = (saved_bytes({**case, "layers": n}, groups) for n in (2, 4))
        tokens = case["seq_len"] * case["seqs"]
        measured = (four - two) / 2 / tokens
        arch = Architecture.from_hf_config(actor_memory.hf_config({**case, "layers": 4}))
        planned = activation_bytes_per_token_layer(arch, tp=1, sequence_parallel=False, seq_len=case["seq_len"],
                                                   flash=False, recompute="none", a=4)  # fmt: skip
        print(json.dumps({"benchmark": "saved_activations", "moe": bool(shape.get("experts")), **shape, "dtype": "float32", "torch": torch.__version__,
                          "measured_bytes_per_token_layer": measured, "planned_bytes_per_token_layer": planned,
                          "planned_over_measured": planned / measured}), flush=True)  # fmt: skip
    destroy_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
