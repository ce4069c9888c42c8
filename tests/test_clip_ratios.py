"""grpo.algorithm.clipping: TRL 1.16's clip_ratio/* against a plain loop, a hand case, and the surrogate's own
clip fraction (region = the tokens where min() took the clipped branch)."""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import ragged_mask, ref_clip_ratios
from grpo.algorithm import policy_loss
from grpo.algorithm.clipping import clip_counts


def ratios(counts):
    units = float(counts.units)
    low = counts.row_low[~torch.isnan(counts.row_low)]
    high = counts.row_high[~torch.isnan(counts.row_high)]
    return (float(counts.low) / units, float(counts.high) / units, float(counts.region) / units,
            float(low.min()) if low.numel() else math.nan, float(high.max()) if high.numel() else math.nan)


def test_a_hand_case():
    # row 0 (A = -1): ratios 0.5 (below 0.8: low-clipped), 1.0, 1.5 (high, but A < 0: not clipped)
    # row 1 (A = +1): ratios 1.3 (above 1.28: high-clipped), 0.5 (low, but A > 0: not clipped), padding 9.0
    ratio = torch.tensor([[0.5, 1.0, 1.5], [1.3, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = ratios(clip_counts(ratio, torch.tensor([-1.0, 1.0]), mask, 0.2, 0.28))
    # 5 tokens: 1 low, 1 high, 2 in the region; rows: low shares 1/3 and 0, high shares 0 and 1/2
    assert got == pytest.approx((0.2, 0.2, 0.4, 0.0, 0.5), abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_sequence", [False, True])
def test_matches_a_plain_loop(seed, per_sequence):
    gen = torch.Generator().manual_seed(seed)
    N, L = 6, 7
    mask = ragged_mask(N, L, gen)
    mask[2] = 0  # a row without loss tokens: NaN row share, skipped by min/max (TRL's nanmin/nanmax)
    ratio = torch.exp(torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.4)
    if per_sequence:
        ratio = ratio[:, :1].expand(N, L)
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    want = ref_clip_ratios(ratio.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.3, per_sequence)
    got = ratios(clip_counts(ratio, adv, mask, 0.2, 0.3, per_sequence=per_sequence))
    assert got == pytest.approx(want, abs=1e-12, nan_ok=True)


def test_policy_loss_reports_them_and_region_is_the_surrogates_clip_fraction():
    gen = torch.Generator().manual_seed(7)
    N, L = 8, 5
    mask = ragged_mask(N, L, gen)
    old = torch.randn(N, L, generator=gen, dtype=torch.float64)
    logp = old + 0.5 * torch.randn(N, L, generator=gen, dtype=torch.float64)
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    _, stats = policy_loss(logp, old, None, adv, mask, epsilon=0.2, epsilon_high=0.28, beta=0.0)
    ratio = torch.exp(logp - old)
    low, high, region, low_min, high_max = ref_clip_ratios(ratio.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28)
    units = float(stats["clip_units"])
    assert (float(stats["clip_low"]) / units, float(stats["clip_high"]) / units) == pytest.approx((low, high))
    assert float(stats["clip_region"]) / units == pytest.approx(region)
    assert (float(stats["clip_low_row_min"]), float(stats["clip_high_row_max"])) == pytest.approx((low_min, high_max))
    assert region == pytest.approx(float(stats["clip_fraction"]), abs=1e-12) and region > 0  # it clips something
