"""Which tokens the clipped surrogate clipped, counted as TRL 1.16 logs them (``clip_ratio/*``).

A token is low-clipped when its ratio fell below ``1 - epsilon_low`` with a negative advantage, high-clipped
when it rose above ``1 + epsilon_high`` with a positive one: exactly where ``min(ratio*A, clip(ratio)*A)`` takes
the clipped branch, so ``region = low | high`` is the surrogate's clip fraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ClipCounts:
    """A micro-batch's clipped units (tokens; rows at the sequence importance level, as TRL counts them).

    low, high, region, units: 0-d float counts; the means are ``low / units`` etc., summed over micro-batches
        and ranks first (TRL's ``global_masked_mean``).
    row_low, row_high: [N] each row's share of low / high clipped tokens (its flag at the sequence level);
        NaN for a row without loss tokens at the token level, which TRL's nanmin/nanmax skip.
    """

    low: Tensor
    high: Tensor
    region: Tensor
    units: Tensor
    row_low: Tensor
    row_high: Tensor


def clip_counts(ratio: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float, epsilon_high: float,
                per_sequence: bool = False) -> ClipCounts:
    """Args:
        ratio: ``[N, L]`` importance ratios (at the sequence level every token of a row holds the row's ratio).
        advantages: ``[N]`` or ``[N, L]``.
        mask: ``[N, L]`` 1 for the tokens that carry the loss.
        per_sequence: count rows instead of tokens (``importance_sampling_level="sequence"``): TRL's ratio is
            then ``[N, 1]`` and every row counts once, with or without tokens.
    """
    ratio, mask = ratio.detach(), mask.to(ratio.dtype)
    adv = advantages.detach().to(ratio.dtype)
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)  # [N, L] or [N, 1]
    if per_sequence:
        ratio, adv = ratio[:, :1], adv[:, :1]  # [N, 1]: one ratio per row
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(ratio.dtype)  # [N, L] or [N, 1]
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(ratio.dtype)
    region = torch.maximum(low, high)
    if per_sequence:
        units = ratio.new_tensor(float(ratio.shape[0]))
        return ClipCounts(low.sum(), high.sum(), region.sum(), units, low[:, 0], high[:, 0])
    tokens = mask.sum(-1)  # [N]
    return ClipCounts((low * mask).sum(), (high * mask).sum(), (region * mask).sum(), tokens.sum(),
                      (low * mask).sum(-1) / tokens, (high * mask).sum(-1) / tokens)  # 0/0 = NaN for empty rows
