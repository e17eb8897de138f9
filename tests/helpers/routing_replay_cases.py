"""Routing-replay cases of the 2-rank MoE actor job (tests/helpers/actor_moe_worker.py),
checked in tests/distributed/test_actor_moe.py.

The reference is ``transformers``' Qwen3-MoE in float32, one sequence at a time, with each
router's choices forced by a forward hook on its ``gate`` (batch-major token order, HF's
own softmax; the actor's routers see position-major order, megatron's formulas): the
log-probs of a replayed actor forward must equal the forced HF forward's.

"Engine" routes are those of a perturbed copy of the model (router weights plus noise), so
they differ from the actor's own on some choices; "own" routes are the unperturbed HF
model's, which the actor's routers make too. Each sequence's last token and the padding
have no route (-1).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rl.actor.batch import NO_ROUTE

TEMPERATURE = 0.7
"""The actor job's rollout temperature (the log-probs' temperature)."""


def _gates(model) -> list:
    return [layer.mlp.gate for layer in model.model.layers]


def hf_routes(model, batch) -> torch.Tensor:
    """``[N, L, M, k]`` the experts ``model``'s routers choose for each real token but each
    sequence's last (``NO_ROUTE`` there and on padding)."""
    gates = _gates(model)
    k = gates[0].top_k
    n, length = batch.input_ids.shape
    routes = torch.full((n, length, len(gates), k), NO_ROUTE, dtype=torch.int64)
    for i, size in enumerate(batch.lengths.tolist()):
        seen: list = []
        handles = [g.register_forward_hook(lambda m, a, out: seen.append(out[2].detach())) for g in gates]
        try:
            with torch.no_grad():
                model(batch.input_ids[i : i + 1, :size])
        finally:
            for h in handles:
                h.remove()
        routes[i, : size - 1] = torch.stack(seen, dim=1)[: size - 1]
    return routes


def forced_logprobs(model, batch, routes: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``[N, L]`` log-probs (input-aligned, 0 at column 0 and padding) of ``model`` with its
    routers taking ``routes`` where given (the gating weights: its own softmax at them,
    renormalised as the model's ``norm_topk_prob`` says), and the share of the given
    choices each router's own top-k made too (on its input in that forward)."""
    gates = _gates(model)
    logp = torch.zeros(batch.input_ids.shape)
    counts = [0, 0]

    def force(layer: int, row: int):
        def hook(gate, args, out):
            logits, _, own = out
            target = routes[row, : own.shape[0], layer]
            counts[0] += int(agreement(own, target, count=True))
            counts[1] += int((target[:, 0] >= 0).sum()) * target.shape[1]
            indices = torch.where(target[:, :1] >= 0, target, own)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return hook

    for i, size in enumerate(batch.lengths.tolist()):
        handles = [g.register_forward_hook(force(j, i)) for j, g in enumerate(gates)]
        try:
            with torch.no_grad():
                logits = model(batch.input_ids[i : i + 1, :size]).logits[0].float()
        finally:
            for h in handles:
                h.remove()
        tokens = batch.input_ids[i, 1:size]
        logp[i, 1:size] = torch.log_softmax(logits[:-1] / TEMPERATURE, dim=-1).gather(1, tokens[:, None])[:, 0]
    return logp, counts[0] / counts[1]


def agreement(own: torch.Tensor, engine: torch.Tensor, *, count: bool = False) -> float:
    """The share (or with ``count`` the number) of the engine's given (token, layer, k)
    choices that ``own`` makes too."""
    given = engine[..., 0] >= 0
    same = (engine[..., :, None] == own[..., None, :]).any(-1) & given[..., None]
    return float(same.sum()) if count else float(same.sum()) / float(given.sum() * engine.shape[-1])


def reference(hf_dir: str, batch) -> dict:
    """The HF side (rank 0): own and engine routes, the expected agreement, and the forced
    log-probs for the engine routes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    own = hf_routes(model, batch)
    perturbed = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for gate in _gates(perturbed):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=g) * gate.weight.std())
    engine = hf_routes(perturbed, batch)
    forced_logp, forced_agreement = forced_logprobs(model, batch, engine)
    return {
        "own": own,
        "engine": engine,
        "agreement": forced_agreement,
        "unforced_agreement": agreement(own, engine),
        "forced_logp": forced_logp,
    }


def run_cases(build, hf_dir: str, batch) -> dict:
    """Every replay case on this job's 2 ranks; the same report on each rank."""
    import torch.distributed as dist

    box = [reference(hf_dir, batch) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False  # column 0 has no log-prob

    def replayed(actor, routes) -> tuple[torch.Tensor, float | None]:
        out = actor.compute_logprobs(replace(batch, routed_experts=routes))
        return out.logp, out.routing_agreement

    def against_hf(**layout) -> dict:
        actor = build(**layout)
        actor.load_hf_weights(hf_dir)
        actor.enable_routing_replay()
        logp, agreed = replayed(actor, ref["engine"])
        return {"logp": float((logp - ref["forced_logp"])[real].abs().max()), "agreement": agreed}

    report: dict = {"expected_agreement": ref["agreement"], "unforced_agreement": ref["unforced_agreement"]}
    # The same routing replayed or not: identical log-probs, agreement 1.
    actor = build(aux=0.0)
    actor.load_hf_weights(hf_dir)
    plain = actor.compute_logprobs(batch).logp
    actor.enable_routing_replay()
    same, same_agreement = replayed(actor, ref["own"])
    engine_logp, engine_agreement = replayed(actor, ref["engine"])
    report["own_routes"] = {"logp": float((same - plain).abs().max()), "agreement": same_agreement}
    report["padded"] = {"logp": float((engine_logp - ref["forced_logp"])[real].abs().max()),
                        "agreement": engine_agreement, "unreplayed_logp": float((plain - ref["forced_logp"])[real].abs().max())}  # fmt: skip
    errors = {}
    too_high = ref["engine"].clone()
    too_high[0, 0, 0, 0] = actor.transformer_config.num_moe_experts
    for name, routes in (("top_1", ref["engine"][..., :1]), ("unknown_expert", too_high)):
        try:
            replayed(actor, routes)
        except ValueError as e:  # raised on every rank before any collective
            errors[name] = str(e)
    report["errors"] = errors
    report["packed"] = against_hf(aux=0.0, pack=True)
    report["ep2"] = against_hf(ep=2, aux=0.0)
    report["tp2_sp"] = against_hf(tp=2, aux=0.0)
    report["pp2"] = against_hf(pp=2, aux=0.0)
    # Training: a full activation recompute re-runs the routers in the backward pass; they
    # must route as the forward did (else the gradient is another sub-network's).
    rl = replace(batch, routed_experts=ref["engine"], old_logp=ref["forced_logp"], ref_logp=ref["forced_logp"])
    steps = {}
    for granularity in ("none", "full"):
        actor = build(ep=2, recompute_granularity=granularity)
        actor.load_hf_weights(hf_dir)
        actor.enable_routing_replay()
        metrics = actor.train_step(rl)
        steps[granularity] = {"metrics": metrics, "weights": dict(actor.iter_hf_weights(bucket_bytes=1 << 20))}
    report["recompute"] = {
        "loss": [steps[g]["metrics"]["loss/total"] for g in ("full", "none")],
        "agreement": [steps[g]["metrics"].get("moe/routing_agreement") for g in ("full", "none")],
        "weights": max(
            float((steps["full"]["weights"][k] - w).abs().max()) for k, w in steps["none"]["weights"].items()
        ),
    }
    return report
