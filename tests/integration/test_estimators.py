"""Each advantage estimator and loss variant trains two colocated steps on a tiny random Qwen2 through
the config tree (the path a recipe takes), logging finite metrics."""

from __future__ import annotations

import math

import pytest
from run_helpers import REQUIRED_KEYS, SIGNAL_REWARDS, base_overrides, read_metrics

from grpo.config import load_config
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VARIANTS = {
    "rloo": {"algorithm.advantage_estimator": "rloo"},
    "reinforce_pp": {"algorithm.advantage_estimator": "reinforce_pp"},
    # Two iterations, so the second one's sequence ratios depart from 1 and the clip can act.
    "gspo": {"loss.importance_sampling_level": "sequence", "loss.num_iterations": 2,
             "loss.epsilon": 3e-4, "loss.epsilon_high": 4e-4, "loss.beta": 0.0},
    "dapo": {"loss.loss_type": "dapo", "loss.epsilon_high": 0.28, "loss.beta": 0.0},
    # TRL's objectives, masks and bonus through the config: CISPO with the 80/20 mask, the off-policy mask and an
    # entropy bonus over two iterations; SAPO with GDPO's per-reward normalisation
    "cispo masked": {"loss.loss_type": "cispo", "loss.epsilon_high": 5.0, "loss.top_entropy_quantile": 0.5,
                     "loss.off_policy_mask_threshold": 0.5, "loss.entropy_coef": 0.01, "loss.num_iterations": 2,
                     "loss.adaptive_entropy": True, "loss.entropy_target": 100.0},
    "sapo gdpo": {"loss.loss_type": "sapo", "algorithm.multi_objective_aggregation": "normalize_then_sum"},
}


def test_mask_truncated_completions_masks_every_cut_off_completion(tiny_model_dir, tmp_path):
    # A random model almost never samples EOS within 12 tokens: every completion is cut off, so with the
    # DAPO mask no token carries loss. The step must still run, with a loss and gradient of exactly 0
    # (dapo's global token count is then 0, and 0/0 must not become NaN).
    out = tmp_path / "masked"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{
        "train.max_steps": 2, "train.save_steps": 100, "log.report_to": "[]", "rewards": SIGNAL_REWARDS,
        "loss.loss_type": "dapo", "loss.mask_truncated_completions": True, "loss.beta": 0.0}))
    train(cfg)
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["truncated_fraction"] for r in rows] == [1.0, 1.0]
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(0.0, 0.0), (0.0, 0.0)]
    assert all(r["entropy"] > 0 for r in rows)  # measured over every sampled token, masked or not


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_trains_with_finite_metrics(variant, tiny_model_dir, tmp_path):
    # SIGNAL_REWARDS: the letters reward varies within groups, so advantages are not 0
    out = tmp_path / variant
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{"train.max_steps": 2, "train.save_steps": 100,
                                                                   "log.report_to": "[]", "rewards": SIGNAL_REWARDS,
                                                                   **VARIANTS[variant]}))
    train(cfg)
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert REQUIRED_KEYS <= set(row), REQUIRED_KEYS - set(row)
        for key in REQUIRED_KEYS | {"ratio_mean", "advantage/abs_mean"}:
            assert math.isfinite(row[key]), (key, row[key])
        assert row["entropy"] > 0 and row["advantage/abs_mean"] > 0 and row["grad_norm"] > 0
    if variant == "cispo masked":  # the adaptive coefficient: logged, moved every update, kept in the checkpoint
        import json

        assert [r["entropy_coef"] for r in rows] == pytest.approx([0.02, 0.03])  # 0.01 + 0.005 after each update
        state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
        assert state["adaptive_entropy"]["coef"] == pytest.approx(0.03)
    if variant == "gspo":
        assert any(r["clip_fraction"] > 0 for r in rows)  # tiny clips on a moved policy: some rows clipped
