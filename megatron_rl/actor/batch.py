"""The actor's batch container and its split into data-parallel shards and micro-batches.

Alignment (one convention everywhere in the actor)
--------------------------------------------------
Every per-token tensor is ``[N, L]`` and aligned with ``input_ids``: column ``t`` is
about token ``input_ids[:, t]``, the token *predicted* by the logits at position
``t - 1``. So ``old_logp[i, t] = log p(input_ids[i, t] | input_ids[i, :t])``;
``loss_mask[i, t] = 1`` trains on that prediction; ``advantages[i, t]`` is its
advantage. Column 0 has no prediction and must be masked out. Internally the logits at
position ``t`` meet the target ``input_ids[:, t + 1]`` (the micro-batches below hold
the shifted, target-aligned tensors), and the log-probs the actor returns are shifted
back into the input alignment above.

Padding: sequences are RIGHT-padded (``attention_mask`` is ones then zeros per row).
Attention is causal with no padding mask, which is exact for right padding (a real
token never attends to a later pad). Positions are ``0..L-1``: megatron's RoPE uses the
position in the sequence, so ``position_ids``, if given, must be that ``arange``.

Micro-batches come in two layouts (``make_microbatches(pack=...)``,
``trainer.pack_sequences``):

- padded: ``[b, s]``, the micro-batch's rows trimmed to its longest sequence
  (:func:`plan_microbatches` groups similar lengths);
- packed: ``[1, S]``, whole sequences laid end to end without padding
  (:func:`plan_packs` fills a token budget), with ``cu_seqlens`` marking the sequence
  boundaries. The model attends within a sequence only and restarts RoPE positions at
  each boundary (megatron's packed-sequence path, ``PackedSeqParams`` in THD layout);
  every target, mask and RL tensor is shifted per sequence, so nothing crosses a
  boundary.

Either may be padded further at the end, to a sequence multiple the kernels need
(``pad_to_multiple_of``); in a packed micro-batch that padding is a segment of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

__all__ = [
    "AUTO_PACK_PADDING_FRACTION",
    "ActorBatch",
    "MicroBatch",
    "NO_ROUTE",
    "filler_microbatch",
    "make_microbatches",
    "padding_fraction",
    "plan_microbatches",
    "plan_packs",
    "prompt_response_batch",
    "resolve_packing",
]

NO_ROUTE = -1
"""A ``routed_experts`` entry for a token the engine did not route (the actor routes it)."""

AUTO_PACK_PADDING_FRACTION = 0.2
"""``trainer.pack_sequences: auto`` without Transformer Engine packs when the padded plan's
padding is more than this share of its tokens. Measured on the local spec (CPU, 2 cores):
a packed forward/backward cost 1.2x the padded one with no padding to remove
(``benchmarks/pack_ab.py``), and packing cut the update to 0.63x with 47% padding
(``benchmarks/async_packing.py``)."""


@dataclass(kw_only=True)
class ActorBatch:
    """A padded batch of sequences (prompt + response) and the per-token RL tensors.

    All tensors are ``[N, L]`` on the CPU (or the actor's device), aligned with
    ``input_ids`` as described in the module docstring.
    """

    input_ids: torch.Tensor
    """``[N, L]`` int64 token ids, right-padded (pad ids may be anything in the vocabulary)."""

    attention_mask: torch.Tensor
    """``[N, L]`` 1 for real tokens, 0 for right padding."""

    loss_mask: torch.Tensor | None = None
    """``[N, L]`` 1 for response tokens to train on (``loss_mask[:, 0]`` must be 0); needed by ``train_step``."""

    old_logp: torch.Tensor | None = None
    """``[N, L]`` float, old-policy log-prob of ``input_ids[:, t]`` (from ``compute_logprobs``
    at the rollout temperature); needed by ``train_step``."""

    ref_logp: torch.Tensor | None = None
    """``[N, L]`` float, reference-policy log-probs; needed when ``kl_coef > 0``."""

    advantages: torch.Tensor | None = None
    """``[N, L]`` float token advantages BEFORE Advantage Reweighting (``train_step`` applies
    AR from ``old_logp``); needed by ``train_step``."""

    engine_logp: torch.Tensor | None = None
    """``[N, L]`` float32 log-probs the rollout engines reported for the response tokens (0
    elsewhere): the behaviour policy, compared with ``old_logp`` for the mismatch metrics
    and the truncated importance weights."""

    position_ids: torch.Tensor | None = None
    """Optional ``[N, L]``; must equal ``arange(L)`` per row (RoPE positions are implicit)."""

    routed_experts: torch.Tensor | None = None
    """Optional ``[N, L, M, k]`` integer: the experts the rollout engine routed token
    ``input_ids[i, t]`` to in each of the model's ``M`` MoE layers (its top-k), -1 where it
    routed none (each sequence's last token, padding). With it, a policy with routing
    replay routes by it (``actor/routing_replay.py``). Input-aligned, not shifted."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [N, L], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and f.name != "routed_experts" and t.shape != shape:
                raise ValueError(f"{f.name} has shape {tuple(t.shape)}; input_ids is {tuple(shape)}")
        routes = self.routed_experts
        if routes is not None and (routes.dim() != 4 or routes.shape[:2] != shape):
            raise ValueError(f"routed_experts has shape {tuple(routes.shape)}; want [N, L, M, k] with "
                             f"[N, L] = {tuple(shape)}")  # fmt: skip
        mask = self.attention_mask.bool()
        lengths = mask.sum(dim=1)
        prefix = torch.arange(shape[1], device=mask.device)[None, :] < lengths[:, None]
        if not torch.equal(mask, prefix):
            row = int(torch.nonzero((mask != prefix).any(dim=1))[0, 0])
            raise ValueError(f"attention_mask row {row} is not right-padded (ones then zeros)")
        if bool((lengths == 0).any()):
            raise ValueError("every sequence needs at least one token")
        if self.position_ids is not None:
            expected = torch.arange(shape[1], device=self.position_ids.device).expand(shape)
            if not torch.equal(self.position_ids.long(), expected):
                raise ValueError("position_ids must be arange(L) per row (megatron's RoPE ignores custom positions)")
        if self.loss_mask is not None:
            if bool(self.loss_mask[:, 0].bool().any()):
                raise ValueError("loss_mask[:, 0] must be 0: column 0 has no prediction")
            if bool((self.loss_mask.bool() & ~mask).any()):
                raise ValueError("loss_mask marks padding positions (attention_mask == 0)")

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` int64 real-token count per row."""
        return self.attention_mask.bool().sum(dim=1)

    def select(self, rows: torch.Tensor | list[int]) -> "ActorBatch":
        """The sub-batch of ``rows`` (index tensor or list), every tensor indexed alike."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return replace(self, **{f.name: _index(getattr(self, f.name), index) for f in fields(self)})

    def require_training_fields(self, need_ref: bool, *, need_old: bool = True, need_advantages: bool = True) -> None:
        """Raise naming the first missing field ``train_step`` needs."""
        names = ("loss_mask",) + (("old_logp",) if need_old else ()) + (("advantages",) if need_advantages else ())
        for name in names + (("ref_logp",) if need_ref else ()):
            if getattr(self, name) is None:
                raise ValueError(f"train_step needs batch.{name}")


def prompt_response_batch(rows: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_id: int) -> ActorBatch:
    """``[N, L]`` right-padded rows of ``(prompt ids, response ids)`` (``L`` = the longest
    row), ``loss_mask`` 1 on the response tokens; ``pad_id`` fills the padding (never
    trained on; any id in the vocabulary)."""
    width = max(len(prompt) + len(response) for prompt, response in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        p, end = len(prompt), len(prompt) + len(response)
        input_ids[i, :p] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[i, p:end] = torch.as_tensor(response, dtype=torch.long)
        attention[i, :end] = 1
        loss_mask[i, p:end] = 1
    return ActorBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask)


def _index(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[rows.to(t.device)]


@dataclass(kw_only=True)
class MicroBatch:
    """One forward/backward unit in TARGET alignment, padded ``[b, s]`` or packed ``[1, S]``.

    ``rows`` index the sequences in the batch the micro-batch was cut from. Padded, token
    tensors are ``[b, s]`` (``s`` = longest sequence); column ``t`` holds the prediction
    made at position ``t``: the target is ``input_ids[:, t + 1]`` (0 in the last column),
    and the per-token RL tensors are the input-aligned ones shifted left by one. Packed,
    they are ``[1, S]``: the sequences ``rows`` end to end (``cu_seqlens``), each shifted
    on its own (its last token has target 0 and no mask), then the alignment padding.
    """

    rows: torch.Tensor
    """``[b]`` int64 row indices into the batch the micro-batch was cut from (pack order)."""
    input_ids: torch.Tensor
    """``[b, s]`` model input (``s`` = longest sequence of the micro-batch), or ``[1, S]`` packed."""
    targets: torch.Tensor
    """``input_ids`` shifted left by one within each sequence (0 at each sequence's end)."""
    target_mask: torch.Tensor
    """bool, positions whose target is a real token (for log-probs)."""
    cu_seqlens: torch.Tensor | None = None
    """Packed only: ``[k + 1]`` int32 offsets of the segments in the row: the ``b`` sequences,
    then the alignment padding as one more segment when there is any (``cu_seqlens[-1] = S``)."""
    max_seqlen: int = 0
    """Packed only: the longest segment (megatron sizes the RoPE table from it)."""
    num_real_tokens: int = 0
    """Tokens of the sequences themselves (the rest of ``input_ids`` is padding)."""
    loss_mask: torch.Tensor | None = None
    """``[b, s]`` predictions to train on (shifted ``loss_mask``)."""
    old_logp: torch.Tensor | None = None
    """``[b, s]`` shifted old-policy log-probs."""
    ref_logp: torch.Tensor | None = None
    """``[b, s]`` shifted reference log-probs."""
    advantages: torch.Tensor | None = None
    """``[b, s]`` shifted advantages (reweighting applied by ``train_step``)."""
    engine_logp: torch.Tensor | None = None
    """``[b, s]`` shifted engine log-probs (an on-policy step's TIS reads them in the loss)."""
    routed_experts: torch.Tensor | None = None
    """``[b, s, M, k]`` (``[1, S, M, k]`` packed) the engine's experts per token and MoE
    layer, aligned with ``input_ids`` (NOT shifted: routing is about the input token), -1
    on padding and where the engine routed none."""

    @property
    def num_tokens_padded(self) -> int:
        """Tokens the model runs on, padding included."""
        return int(self.input_ids.numel())

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens the model runs on that are padding."""
        return 1.0 - self.num_real_tokens / self.num_tokens_padded

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def segment_ids(self) -> torch.Tensor:
        """``[1, S]`` int64 segment of each packed position (``0..b-1`` the sequences, ``b``
        the alignment padding): the sequence ids of seq-mean aggregation."""
        cu = self.cu_seqlens.to(self.input_ids.device, torch.int64)
        positions = torch.arange(self.input_ids.shape[1], device=cu.device)
        return (torch.searchsorted(cu[1:], positions, right=True))[None]

    def position_ids(self) -> torch.Tensor:
        """RoPE positions, ``[b, s]`` (``0..s-1`` per row) or ``[1, S]`` restarting at 0 at
        each packed sequence."""
        b, s = self.input_ids.shape
        positions = torch.arange(s, device=self.input_ids.device)
        if not self.packed:
            return positions.expand(b, s)
        starts = self.cu_seqlens.to(positions.device, torch.int64)[self.segment_ids()[0]]
        return (positions - starts)[None]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """Target-aligned per-token ``values`` (``[b, s]``, or ``[1, S]`` packed) as one
        zero-padded row per sequence of ``rows``: ``[len(rows), s]``, ``s`` the longest."""
        values = values.reshape(self.input_ids.shape)
        if not self.packed:
            return values
        lengths = self.cu_seqlens[1 : len(self.rows) + 1] - self.cu_seqlens[: len(self.rows)]
        longest = int(lengths.max())
        valid = torch.arange(longest)[None, :] < lengths[:, None].cpu()
        out = values.new_zeros(len(self.rows), longest)
        out[valid.to(values.device)] = values[0, : int(self.cu_seqlens[len(self.rows)])]
        return out


def plan_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` PADDED tokens.

    A micro-batch of ``b`` sequences trimmed to its longest length ``s`` costs ``b * s``.
    Sequences are taken longest first (stable), so each micro-batch holds sequences of
    similar length and padding stays small; a sequence longer than the budget gets a
    micro-batch of its own. Deterministic: every rank of a model-parallel group computes
    the same plan from the same batch.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        candidate = max(longest, lengths[i])
        if current and candidate * (len(current) + 1) > max_tokens:
            plan.append(current)
            current, longest = [], 0
            candidate = lengths[i]
        current.append(i)
        longest = candidate
    if current:
        plan.append(current)
    return plan


def padding_fraction(lengths: list[int], max_tokens: int, pad_to_multiple_of: int = 1) -> float:
    """Share of padding among the tokens of the padded micro-batches
    (:func:`plan_microbatches` of ``lengths`` rounded up to ``pad_to_multiple_of``)."""
    padded = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
    total = sum(len(rows) * max(padded[i] for i in rows) for rows in plan_microbatches(padded, max_tokens))
    return 1.0 - sum(lengths) / total


def resolve_packing(
    pack_sequences: bool | str, lengths: list[int], max_tokens: int, pad_to_multiple_of: int = 1, *, use_te: bool
) -> bool:
    """Whether a pass over sequences of ``lengths`` runs packed (``trainer.pack_sequences``):
    true/false as set; ``auto`` packs with Transformer Engine, else when the padded plan's
    :func:`padding_fraction` exceeds :data:`AUTO_PACK_PADDING_FRACTION`. Deterministic, so
    every pipeline stage and TP rank given the same rows decides alike."""
    if pack_sequences == "auto":
        return use_te or padding_fraction(lengths, max_tokens, pad_to_multiple_of) > AUTO_PACK_PADDING_FRACTION
    return bool(pack_sequences)


def plan_packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into packs of at most ``max_tokens`` REAL tokens.

    First-fit decreasing: sequences are taken longest first (stable) and each goes into
    the first pack with room for it, so packs come out nearly full whatever the length
    mix; a sequence longer than the budget gets a pack of its own. Within a pack the
    sequences keep the order they were added in. Deterministic (every rank of a
    model-parallel group computes the same plan).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for k, free in enumerate(room):
            if lengths[i] <= free:
                packs[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(max_tokens - lengths[i])
    return packs


def _cut_routes(t: torch.Tensor | None, s: int, device) -> torch.Tensor | None:
    """``[b, L, M, k]`` routes trimmed or padded (``NO_ROUTE``) to ``s`` positions (``None`` stays ``None``)."""
    if t is None:
        return None
    t = t[:, :s]
    if t.shape[1] < s:
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, s - t.shape[1]), value=NO_ROUTE)
    return t.to(device)


def _shift_left(t: torch.Tensor | None, fill: float = 0) -> torch.Tensor | None:
    if t is None:
        return None
    out = torch.full_like(t, fill)
    out[:, :-1] = t[:, 1:]
    return out


def make_microbatches(
    batch: ActorBatch,
    max_tokens: int,
    *,
    device: torch.device | str = "cpu",
    pad_to_multiple_of: int = 1,
    pack: bool = False,
) -> list[MicroBatch]:
    """Cut ``batch`` into micro-batches in target alignment: padded ``[b, s]``
    (:func:`plan_microbatches`) or, with ``pack``, packed ``[1, S]`` (:func:`plan_packs`).

    Padded micro-batches are trimmed to their longest sequence and rounded up to a
    multiple of ``pad_to_multiple_of`` (what Transformer Engine's FP8 GEMMs or sequence
    parallelism need); the budget counts the padded lengths. Packed ones hold whole
    sequences end to end and are rounded up as a whole, so one pack may exceed the budget
    by less than the multiple. Padding holds token 0 and is masked out of everything, so
    it changes no log-prob, loss or gradient.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    lengths = batch.lengths.tolist()
    if pack:
        return [_pack(batch, rows, lengths, device, pad_to_multiple_of) for rows in plan_packs(lengths, max_tokens)]
    padded = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
    out = []
    for rows in plan_microbatches(padded, max_tokens):
        index = torch.tensor(rows, dtype=torch.long)
        s = max(padded[i] for i in rows)
        sub = batch.select(index)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[:, :s]
            if t.shape[1] < s:  # the padded length exceeds the batch's width
                t = torch.nn.functional.pad(t, (0, s - t.shape[1]))
            return t.to(device)

        input_ids = cut(sub.input_ids).long()
        attn = cut(sub.attention_mask).bool()
        out.append(
            MicroBatch(
                rows=index,
                input_ids=input_ids,
                targets=_shift_left(input_ids),
                target_mask=_shift_left(attn, False),
                loss_mask=_shift_left(cut(sub.loss_mask)),
                old_logp=_shift_left(cut(sub.old_logp)),
                ref_logp=_shift_left(cut(sub.ref_logp)),
                advantages=_shift_left(cut(sub.advantages)),
                engine_logp=_shift_left(cut(sub.engine_logp)),
                routed_experts=_cut_routes(sub.routed_experts, s, device),
                num_real_tokens=sum(lengths[i] for i in rows),
            )
        )
    return out


def filler_microbatch(like: MicroBatch, length: int) -> MicroBatch:
    """A micro-batch of one all-padding row of ``length`` tokens that belongs to no sequence
    (``rows`` empty) and trains on nothing (every mask false): a data-parallel rank with
    fewer micro-batches than the others runs these where the experts' all-to-all spans the
    DP ranks, since every rank of an expert-parallel group must take part in each forward.
    Its optional tensors exist where ``like``'s do. Its tokens are routed like any other,
    so they count in the router's auxiliary losses (weighted by their number, ``length``)."""
    ids = torch.zeros(1, length, dtype=torch.long, device=like.input_ids.device)

    def zeros(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.zeros(1, length, dtype=t.dtype, device=t.device)

    return MicroBatch(
        rows=torch.zeros(0, dtype=torch.long),
        input_ids=ids,
        targets=torch.zeros_like(ids),
        target_mask=torch.zeros_like(ids, dtype=torch.bool),
        loss_mask=zeros(like.loss_mask),
        old_logp=zeros(like.old_logp),
        ref_logp=zeros(like.ref_logp),
        advantages=zeros(like.advantages),
        engine_logp=zeros(like.engine_logp),
        routed_experts=None if like.routed_experts is None else (
            _cut_routes(like.routed_experts[:1, :0], length, ids.device)  # every position NO_ROUTE
        ),
    )


def _pack(batch: ActorBatch, rows: list[int], lengths: list[int], device, multiple: int) -> MicroBatch:
    """The sequences ``rows`` of ``batch`` end to end in one ``[1, S]`` row, each shifted to
    target alignment on its own, then padded to a multiple of ``multiple``."""
    index = torch.tensor(rows, dtype=torch.long)
    sub = batch.select(index)
    s = max(lengths[i] for i in rows)
    real = sub.attention_mask[:, :s].bool()
    total = sum(lengths[i] for i in rows)
    tail = -(-total // multiple) * multiple - total

    def flat(t: torch.Tensor | None, fill=0) -> torch.Tensor | None:
        # Shift each row on its own, then keep its real positions: row-major order lays the
        # sequences end to end, and a sequence's last token keeps the shift's fill value.
        if t is None:
            return None
        out = _shift_left(t[:, :s], fill)[real]
        return torch.nn.functional.pad(out, (0, tail), value=fill)[None].to(device)

    ids = sub.input_ids[:, :s].long()
    # Routes are input-aligned (not shifted): the real positions end to end, then the tail.
    routes = sub.routed_experts
    if routes is not None:
        routes = _cut_routes(routes[:, :s][real][None], total + tail, device)
    bounds = [0] + [lengths[i] for i in rows] + ([tail] if tail else [])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int64).cumsum(0).to(torch.int32)
    return MicroBatch(
        rows=index,
        input_ids=torch.nn.functional.pad(ids[real], (0, tail))[None].to(device),
        targets=flat(ids),
        target_mask=flat(real, False),
        loss_mask=flat(sub.loss_mask),
        old_logp=flat(sub.old_logp),
        ref_logp=flat(sub.ref_logp),
        advantages=flat(sub.advantages),
        engine_logp=flat(sub.engine_logp),
        routed_experts=routes,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(bounds[1:]),
        num_real_tokens=total,
    )
