"""The sampler correction: importance weights ``pi_old / pi_sampler`` (truncated or masked, per token or per
completion) for tokens another engine sampled, and the sampler/trainer log-prob gap the off-policy guard
watches.

``N`` completions of padded length ``L``; masks are ``[N, L]``, 1 for real (sampled) tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from grpo.algorithm.lookup import lookup


# Each mode: (log_ratio [N, L], mask [N, L] float, cap, floor or None) -> (weights [N, L], outside [N, L]
# bool: the ratio above the cap or below the floor).
def _outside(ratio: Tensor, cap: float, floor: float | None) -> Tensor:
    return ratio > cap if floor is None else (ratio > cap) | (ratio < floor)


def _token_truncate(log_ratio: Tensor, mask: Tensor, cap: float, floor: float | None) -> tuple[Tensor, Tensor]:
    ratio = torch.exp(log_ratio)
    return torch.clamp(ratio, min=floor, max=cap), _outside(ratio, cap, floor)


def _token_mask(log_ratio: Tensor, mask: Tensor, cap: float, floor: float | None) -> tuple[Tensor, Tensor]:
    ratio = torch.exp(log_ratio)
    outside = _outside(ratio, cap, floor)
    return ratio.masked_fill(outside, 0.0), outside


def _sequence_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # One ratio per completion: the product of its tokens' (the likelihood ratio of the whole sequence,
    # as TRL's sequence modes; not GSPO's geometric mean), broadcast over its tokens.
    return torch.exp((log_ratio * mask).sum(-1, keepdim=True)).expand_as(log_ratio)  # [N, L]


def _sequence_truncate(log_ratio: Tensor, mask: Tensor, cap: float, floor: float | None) -> tuple[Tensor, Tensor]:
    ratio = _sequence_ratio(log_ratio, mask)
    return torch.clamp(ratio, min=floor, max=cap), _outside(ratio, cap, floor)


def _sequence_mask(log_ratio: Tensor, mask: Tensor, cap: float, floor: float | None) -> tuple[Tensor, Tensor]:
    ratio = _sequence_ratio(log_ratio, mask)
    outside = _outside(ratio, cap, floor)
    return ratio.masked_fill(outside, 0.0), outside


SAMPLER_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float, float | None], tuple[Tensor, Tensor]]] = {
    "token_truncate": _token_truncate,
    "token_mask": _token_mask,
    "sequence_truncate": _sequence_truncate,
    "sequence_mask": _sequence_mask,
}


def sampler_importance_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float,
                               mode: str = "token_truncate", floor: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token weights from ``pi_old / pi_sampler`` for tokens sampled by another engine, bounded by ``cap``
    (and from below by ``floor``, when given).

    A sampler that is not the trainer (vLLM, or a decoupled sampler with stale weights or other numerics)
    draws from a slightly different distribution than the trainer's old policy; weighting each token's
    loss by the ratio corrects the mismatch, and the cap bounds the variance (truncated importance
    sampling, TRL's ``vllm_importance_sampling_correction`` and ``vllm_importance_sampling_mode``).

    Args:
        old_logprobs: ``[N, L]`` the trainer's log-probs of the sampled tokens at the weights that start the update.
        sampler_logprobs: ``[N, L]`` the sampler's own log-probs of the same tokens.
        mask: ``[N, L]`` 1 for real tokens.
        cap: ``C > 0``.
        mode: a name in ``SAMPLER_CORRECTIONS``: ``token_truncate`` ``min(r_t, C)``; ``token_mask`` ``r_t``,
            or 0 where ``r_t > C``; ``sequence_truncate`` / ``sequence_mask`` the same on the completion's
            ratio ``prod_t r_t``, given to each of its tokens.
        floor: ``0 <= C_min < C`` or None (TRL's ``vllm_importance_sampling_clip_min``): the truncate modes
            raise ratios below it to it, the mask modes zero them; None: no lower bound.

    Returns:
        ``(weights, outside)``, both ``[N, L]`` and detached: the weights (0 on padding), and True on the
        real tokens whose ratio was outside ``[floor, cap]`` (truncated or masked).
    """
    if not (old_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if floor is not None and not 0 <= floor < cap:
        raise ValueError(f"floor must be in [0, cap={cap}), got {floor}")
    correct = lookup(SAMPLER_CORRECTIONS, "sampler correction mode", mode)
    with torch.no_grad():
        padding = mask == 0
        log_ratio = (old_logprobs - sampler_logprobs).masked_fill(padding, 0.0)  # [N, L]
        weights, outside = correct(log_ratio, mask.to(log_ratio.dtype), cap, floor)
        return weights.masked_fill(padding, 0.0), outside & ~padding


def truncated_importance_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                                 cap: float) -> Tensor:
    """``[N, L]`` detached weights ``min(exp(old - sampler), cap)`` on real tokens, 0 on padding: the
    ``token_truncate`` mode of ``sampler_importance_weights`` (see there)."""
    return sampler_importance_weights(old_logprobs, sampler_logprobs, mask, cap, "token_truncate")[0]


def logprob_mismatch(sampler_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's, as a masked sum.

    Args:
        sampler_logprobs: ``[N, L]`` the rollout engine's log-prob of each sampled token.
        trainer_logprobs: ``[N, L]`` the trainer's log-prob of the same tokens, same temperature.
        mask: ``[N, L]`` 1 on completion tokens, 0 on padding.

    Returns:
        ``(total, count)``: the sum of |sampler - trainer| over the masked tokens and their number, both
        float64 scalars. A sum and a count rather than the mean, so that ranks can add theirs before
        dividing (the mean over all tokens of the step, not a mean of per-rank means).
    """
    keep = mask.bool()
    gap = (sampler_logprobs.double() - trainer_logprobs.double()).abs()[keep]  # [tokens]
    return gap.sum(), keep.sum().double()
