"""The entropy bonus in the loss (TRL 1.16's ``entropy_coef``) and its adaptive coefficient (``use_adaptive_entropy``,
Skywork-OR1): the loss is ``policy_loss - coef * entropy_bonus``, and ``coef`` follows the measured entropy.

The controller is a pure update of an ``AdaptiveEntropyState``: the caller holds the state, asks
``applied_entropy_coef`` for the coefficient of every micro-batch of an optimizer step, adds up ``entropy_sums``
over the step's micro-batches and ranks, and at the step's end calls ``adaptive_entropy_step``.
``N`` completions of padded length ``L``; masks ``[N, L]``, 1 for the tokens the bonus acts on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def entropy_bonus(entropy: Tensor, mask: Tensor) -> Tensor:
    """The mean per-token entropy over ``mask``: the term ``coef`` multiplies (0-d, with ``entropy``'s gradient).

    Args:
        entropy: ``[N, L]`` per-token entropy of the policy's distribution (with gradient).
        mask: ``[N, L]`` the tokens it acts on: TRL's are the loss tokens, times ``high_entropy_mask`` when
            ``top_entropy_quantile < 1`` (never the off-policy mask).

    Returns:
        0-d ``sum(entropy * mask) / max(sum(mask), 1)``: a mean whatever the loss type's aggregation, so ``coef``
        means the same for every loss type (TRL). Under gradient accumulation TRL weighs each micro-batch's
        bonus by ``1 / gradient_accumulation_steps``, also for the loss types normalised by the global token count.
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} differ")
    m = mask.to(entropy.dtype)
    return (entropy.masked_fill(m == 0, 0.0) * m).sum() / m.sum().clamp(min=1)  # padding's inf must not be NaN


def entropy_sums(entropy: Tensor, mask: Tensor) -> Tensor:
    """``[2]`` detached (sum of ``entropy`` over ``mask``, token count): what the controller adds up over an
    optimizer step's micro-batches and ranks before dividing (a token-weighted mean over the whole step)."""
    m = mask.to(entropy.dtype)
    return torch.stack([(entropy.detach().masked_fill(m == 0, 0.0) * m).sum(), m.sum()])


@dataclass(frozen=True)
class AdaptiveEntropyState:
    """The controller's state between optimizer steps (what TRL checkpoints).

    coef: the coefficient (TRL's ``entropy_coef``, its initial value at the start).
    last_entropy: the mean entropy measured at the last optimizer step; inf before the first, so that no bonus
        applies until a measurement arrives.
    """

    coef: float
    last_entropy: float = math.inf


def applied_entropy_coef(state: AdaptiveEntropyState, target: float) -> float:
    """The coefficient every micro-batch of the coming optimizer step applies: ``state.coef`` when the last
    measured entropy is at or below ``target`` (TRL's ``entropy_target``), else 0 (the bonus only engages once
    entropy has fallen to the target)."""
    return state.coef if state.last_entropy <= target else 0.0


def adaptive_entropy_step(state: AdaptiveEntropyState, window_sums: Tensor | tuple[float, float], *, target: float,
                          coef_delta: float, coef_min: float, coef_max: float) -> AdaptiveEntropyState:
    """The state after an optimizer step: ``coef + coef_delta`` (at most ``coef_max``) when the step's entropy is
    at or below ``target``, else ``coef - coef_delta`` (at least ``coef_min``); the step's entropy is remembered.

    Args:
        state: the state the step started with.
        window_sums: (entropy sum, token count) over the step's micro-batches and ranks (``entropy_sums`` added
            up); the step's entropy is ``sum / max(count, 1)``.
        target, coef_delta, coef_min, coef_max: TRL's ``entropy_target``, ``entropy_coef_delta``,
            ``entropy_coef_min``, ``entropy_coef_max``.
    """
    total, count = (float(v) for v in window_sums)
    entropy = total / max(count, 1.0)
    if entropy <= target:
        coef = min(state.coef + coef_delta, coef_max)
    else:
        coef = max(state.coef - coef_delta, coef_min)
    return AdaptiveEntropyState(coef=coef, last_entropy=entropy)
