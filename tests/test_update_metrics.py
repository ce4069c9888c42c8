"""grpo.step.metrics' TRL-side statistics: each update's metrics reduced over ranks (TRL's global token means,
nanmin, nanmax), the spreads over every rank's rows (lengths, terminated lengths, reward stds, tokens), and the
evaluation's lengths; each against a plain computation over the pooled rows."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

import pytest

from grpo.step.metrics import reduce_updates, spread_metrics
from grpo.step.records import UpdateStats
from grpo.evaluation.example_records import length_metrics
from grpo.evaluation.sample_metrics import sample_std


def rank_update(loss, low, high, region, units, low_min, high_max, norm=1.0):
    # built from UpdateStats, so that a field the trainer adds reaches this test too
    return asdict(UpdateStats(loss=loss, policy_loss=loss, clip_fraction=0.0, vespo_phi_mean=0.0, kl=0.1, entropy=2.0,
                              ratio_mean=1.0, clip_low=low, clip_high=high, clip_region=region, clip_units=units,
                              clip_low_row_min=low_min, clip_high_row_max=high_max, grad_norm=norm,
                              learning_rate=0.5, seconds=loss))


def test_updates_reduce_over_ranks_as_trl_gathers_them():
    # two ranks, two updates; rank 1's second update had no row with tokens (NaN min/max), and the update
    # after a non-finite gradient was skipped (grad_norm None)
    ranks = [[rank_update(1.0, 2, 1, 3, 10, 0.0, 0.5), rank_update(3.0, 0, 0, 0, 10, 0.25, 0.0, None)],
             [rank_update(2.0, 1, 3, 4, 30, 0.5, 0.75), rank_update(4.0, 0, 0, 0, 0, math.nan, math.nan, None)]]
    first, second = reduce_updates(ranks)
    assert first["loss"] == 1.5 and first["update_s"] == 2.0 and first["grad_norm"] == 1.0
    # 3 low, 4 high, 7 in the region of 40 tokens over both ranks (not the mean of 2/10 and 1/30)
    assert (first["clip_ratio/low_mean"], first["clip_ratio/high_mean"], first["clip_ratio/region_mean"]) == \
        pytest.approx((3 / 40, 4 / 40, 7 / 40))
    assert first["clip_ratio/low_min"] == 0.0 and first["clip_ratio/high_max"] == 0.75
    assert second["clip_ratio/low_min"] == 0.25 and second["clip_ratio/high_max"] == 0.0  # NaN skipped
    assert math.isnan(second["grad_norm"]) and second["clip_ratio/low_mean"] == 0.0


def test_spreads_pool_every_ranks_rows():
    ranks = [{"lengths": [4, 8], "sampled": [4, 8], "truncated": [False, True], "rewards": [[1.0, None], [0.0, 2.0]],
              "names": ["a", "b"], "prompt_tokens": 10},
             {"lengths": [2, 6], "sampled": [2, 6], "truncated": [False, False], "rewards": [[0.5, 1.0], [None, 3.0]],
              "names": ["a", "b"], "prompt_tokens": 12}]
    got = spread_metrics(ranks)
    assert got["completion_length/min"] == 2.0 and got["completion_length/max"] == 8.0  # over both ranks' rows
    assert got["step_tokens"] == 10 + 12 + 20
    ended = [4, 2, 6]  # the truncated 8 left out
    assert (got["terminated_length/mean"], got["terminated_length/min"], got["terminated_length/max"]) == \
        (statistics.mean(ended), 2.0, 6.0)
    assert got["reward_std/a"] == pytest.approx(statistics.stdev([1.0, 0.0, 0.5]))  # abstentions left out
    assert got["reward_std/b"] == pytest.approx(statistics.stdev([2.0, 1.0, 3.0]))
    assert "sampled_length/min" not in got


def test_no_completion_ended_gives_zero_terminated_lengths_as_trl_and_multi_turn_counts_sampled_tokens():
    got = spread_metrics([{"lengths": [9, 7], "sampled": [5, 3], "truncated": [True, True], "rewards": [[1.0], [1.0]],
                           "names": ["a"], "prompt_tokens": 4}])
    assert (got["terminated_length/mean"], got["terminated_length/min"], got["terminated_length/max"]) == (0, 0, 0)
    assert (got["sampled_length/min"], got["sampled_length/max"]) == (3.0, 5.0) and got["step_tokens"] == 12
    assert (got["completion_length/min"], got["completion_length/max"]) == (7.0, 9.0)
    assert got["reward_std/a"] == 0.0


def test_sample_std_and_eval_lengths():
    assert sample_std([1.0, 2.0, 4.0]) == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
    assert math.isnan(sample_std([1.0]))
    records = [{"length": 5, "truncated": False}, {"length": 8, "truncated": True}, {"length": 3, "truncated": False}]
    assert length_metrics(records) == {
        "completion_length/mean": pytest.approx(16 / 3), "completion_length/min": 3.0, "completion_length/max": 8.0,
        "terminated_length/mean": 4.0, "terminated_length/min": 3.0, "terminated_length/max": 5.0}
    assert length_metrics([{"truncated": False}]) == {}
