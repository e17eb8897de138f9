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
Packed (unpadded) sequences are not supported. Micro-batches may be padded further, to
a sequence multiple the kernels need (``make_microbatches(pad_to_multiple_of=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["ActorBatch", "MicroBatch", "plan_microbatches", "make_microbatches"]


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

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [N, L], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{f.name} has shape {tuple(t.shape)}; input_ids is {tuple(shape)}")
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

    def require_training_fields(self, need_ref: bool, *, need_old: bool = True) -> None:
        """Raise naming the first missing field ``train_step`` needs."""
        names = ("loss_mask",) + (("old_logp",) if need_old else ()) + ("advantages",)
        for name in names + (("ref_logp",) if need_ref else ()):
            if getattr(self, name) is None:
                raise ValueError(f"train_step needs batch.{name}")


def _index(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[rows.to(t.device)]


@dataclass(kw_only=True)
class MicroBatch:
    """One forward/backward unit, trimmed to its longest sequence, in TARGET alignment.

    ``rows`` index the sequences in the batch the micro-batch was cut from. Token tensors
    are ``[b, s]``; column ``t`` holds the prediction made at position ``t``: the target is
    ``input_ids[:, t + 1]`` (0 in the last column), and the per-token RL tensors are the
    input-aligned ones shifted left by one.
    """

    rows: torch.Tensor
    """``[b]`` int64 row indices into the batch the micro-batch was cut from."""
    input_ids: torch.Tensor
    """``[b, s]`` model input (``s`` = longest sequence of the micro-batch)."""
    targets: torch.Tensor
    """``[b, s]`` ``input_ids`` shifted left by one (0 in the last column)."""
    target_mask: torch.Tensor
    """``[b, s]`` bool, positions whose target is a real token (for log-probs)."""
    loss_mask: torch.Tensor | None = None
    """``[b, s]`` predictions to train on (shifted ``loss_mask``)."""
    old_logp: torch.Tensor | None = None
    """``[b, s]`` shifted old-policy log-probs."""
    ref_logp: torch.Tensor | None = None
    """``[b, s]`` shifted reference log-probs."""
    advantages: torch.Tensor | None = None
    """``[b, s]`` shifted advantages (reweighting applied by ``train_step``)."""

    @property
    def num_tokens_padded(self) -> int:
        return int(self.input_ids.numel())


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


def _shift_left(t: torch.Tensor | None, fill: float = 0) -> torch.Tensor | None:
    if t is None:
        return None
    out = torch.full_like(t, fill)
    out[:, :-1] = t[:, 1:]
    return out


def make_microbatches(
    batch: ActorBatch, max_tokens: int, *, device: torch.device | str = "cpu", pad_to_multiple_of: int = 1
) -> list[MicroBatch]:
    """Cut ``batch`` into micro-batches (:func:`plan_microbatches`), in target alignment.

    Each micro-batch is trimmed to its longest sequence, rounded up to a multiple of
    ``pad_to_multiple_of`` (what Transformer Engine's FP8 GEMMs or sequence parallelism
    need); padding columns hold token 0 and are masked out of everything, so they change
    no log-prob, loss or gradient. The budget counts the padded lengths.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    lengths = batch.lengths.tolist()
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
            )
        )
    return out
