"""The ``toy_copy`` reward of the embedded CPU demo (task and tokenizer: ``megatron_rl.data.toy``).

The prompt is ``copy 3 1 4 =`` and the right response is ``3 1 4`` (then end of sequence).
The reward is dense so that a random-init policy gets a learning signal from step one:

    score = 0.9 * (fraction of target positions whose token is right)
          + 0.1 * (the response has exactly as many tokens as the target, i.e. it stopped)

Tokens are whitespace-separated; ``<eos>`` ends the response and ``<pad>`` is dropped, so
the score does not depend on whether the rollout decodes special tokens. A response of
random tokens from a 15-token vocabulary scores about 0.06 on average; a perfect one 1.0.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.rewards.registry import RewardResult, register_reward

DIGIT_WEIGHT = 0.9
"""Weight of the per-position partial credit."""

STOP_WEIGHT = 0.1
"""Weight of stopping after exactly as many tokens as the target has."""

_EOS, _PAD = "<eos>", "<pad>"


def response_tokens(response: str) -> list[str]:
    """Whitespace tokens of ``response`` up to the first ``<eos>``, without ``<pad>``."""
    tokens = [t for t in response.split() if t != _PAD]
    return tokens[: tokens.index(_EOS)] if _EOS in tokens else tokens


def score_copy(response: str, ground_truth: Any) -> RewardResult:
    """Partial credit per right position plus a bonus for stopping (see module doc)."""
    target_text = ground_truth.get("answer") if isinstance(ground_truth, dict) else ground_truth
    if not isinstance(target_text, str) or not target_text.split():
        raise ValueError(f"toy_copy ground truth must be a non-empty string of tokens, got {ground_truth!r}")
    target = target_text.split()
    tokens = response_tokens(response)
    num_right = sum(1 for got, want in zip(tokens, target) if got == want)
    stopped = len(tokens) == len(target)
    score = DIGIT_WEIGHT * num_right / len(target) + STOP_WEIGHT * stopped
    return RewardResult(score=score, extras={"num_right": num_right, "stopped": stopped})


@register_reward("toy_copy", failure_score=0.0, success_score=1.0)
def toy_copy(response: str, ground_truth: Any) -> RewardResult:
    """Dense copy-task reward in [0, 1]; 1.0 only for the exact target followed by a stop."""
    return score_copy(response, ground_truth)
