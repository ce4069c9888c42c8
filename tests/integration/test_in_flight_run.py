"""Weights updated during generation, end to end: a decoupled run (a sampler process, a trainer process) with
``decoupled.weight_update: in_flight`` and IcePop's band on the sampler's per-token log-probs trains its steps and
logs each token's staleness and the sampler/trainer mismatch."""

from __future__ import annotations

import math
import subprocess

import pytest
from run_helpers import SMOKE, cli_env, decoupled_overrides, each_batch_once, grpo_cmd

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_in_flight_run_trains_and_logs_token_staleness_and_mismatch(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, out, **{
        "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf",
        "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "loss.sampler_is_correction": True, "loss.sampler_is_mode": "token_mask", "loss.sampler_is_cap": 2.0,
        "loss.sampler_is_min": 0.5}))
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # at max_staleness 1 no token's weights are more than one version behind the trainer's
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert row["staleness/token_max"] == row["staleness/mean"]  # the step's oldest token is its chunks' oldest
        assert row["mismatch/k3"] >= 0.0 and row["mismatch/ratio_max"] > 0.0
        assert 0.0 <= row["mismatch/masked_fraction"] <= 1.0 and math.isfinite(row["sampler_is/weight_mean"])
