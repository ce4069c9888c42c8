"""mean@n, unbiased pass@k, maj@n and bootstrap intervals (grpo.evaluation.sample_metrics) against hand values."""

from __future__ import annotations

import math

import pytest

from grpo.rewards import answers_equal
from grpo.evaluation.sample_metrics import bootstrap_interval, default_ks, majority_answer, pass_at_k, sample_metrics


@pytest.mark.parametrize("c, expected", [
    # n = 8: pass@1 = c/8; pass@4 = 1 - C(8-c, 4)/C(8, 4) (C(8, 4) = 70); pass@8 = any correct
    (0, {1: 0.0, 4: 0.0, 8: 0.0}),
    (1, {1: 1 / 8, 4: 1 - 35 / 70, 8: 1.0}),
    (2, {1: 2 / 8, 4: 1 - 15 / 70, 8: 1.0}),
    (3, {1: 3 / 8, 4: 1 - 5 / 70, 8: 1.0}),
    (4, {1: 4 / 8, 4: 1 - 1 / 70, 8: 1.0}),
    (5, {1: 5 / 8, 4: 1.0, 8: 1.0}),
    (8, {1: 1.0, 4: 1.0, 8: 1.0}),
])
def test_pass_at_k_closed_form_for_eight_samples(c, expected):
    for k, value in expected.items():
        assert pass_at_k(8, c, k) == pytest.approx(value, abs=1e-12)
        # the closed form is the chance a random k-subset of the 8 holds a correct sample
        assert pass_at_k(8, c, k) == pytest.approx(1 - math.comb(8 - c, k) / math.comb(8, k), abs=1e-12)


def test_majority_vote_groups_equal_answers_and_breaks_ties_by_first_seen():
    assert majority_answer(["1,080", "7", "1080.0", None, "7 "], answers_equal) == "1,080"  # 2 votes, first
    assert majority_answer(["7", "1,080", "1080", "7"], answers_equal) == "7"  # 2 - 2 tie: the first seen
    assert majority_answer(["3", "4", "4"], answers_equal) == "4"
    assert majority_answer([None, "  ", None], answers_equal) is None  # nothing parsed: no answer
    assert majority_answer([None, None, "5"], answers_equal) == "5"  # unparsed samples never outvote one


def test_sample_metrics_hand_case():
    correct = [[True, False, False, False], [False, False, False, False], [True, True, True, True]]
    metrics = sample_metrics(correct, [False, False, True])
    assert metrics["mean@4"] == pytest.approx(5 / 12)
    assert metrics["pass@1"] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert metrics["pass@2"] == pytest.approx(((1 - 3 / 6) + 0 + 1) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert metrics["maj@4"] == pytest.approx(1 / 3)
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]
    with pytest.raises(ValueError, match="same n"):
        sample_metrics([[True], [True, False]], [True, True])
    with pytest.raises(ValueError, match="majority votes"):
        sample_metrics([[True]], [])


def test_bootstrap_interval_is_deterministic_and_brackets_the_mean():
    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_interval(values, seed=3)
    assert (low, high) == bootstrap_interval(values, seed=3)
    assert low < 0.3 < high and 0.15 < low and high < 0.45
    assert bootstrap_interval([0.5] * 10) == (0.5, 0.5)
    with pytest.raises(ValueError):
        bootstrap_interval([])
