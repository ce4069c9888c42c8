"""Dynamic sampling end to end: `grpo train` on the shipped model drops zero-spread groups and trains only
groups whose rewards differ; on a tiny random model, a resumed run draws the same rounds as an
uninterrupted one, and a run that hits the cap fills its batch and says so."""

from __future__ import annotations

import pytest
from run_helpers import (
    REPO,
    base_overrides,
    colocated_and_decoupled,
    resume_matches_uninterrupted,
    train_rows,
)

from grpo.config import load_config
from grpo.step.dynamic_sampling import zero_spread_groups
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DYNAMIC_KEYS = {"rollout/dynamic_rounds", "rollout/dynamic_prompts_drawn", "rollout/dynamic_groups_dropped",
                "rollout/dynamic_groups_surplus", "rollout/dynamic_groups_filled", "rollout/dynamic_cap_hit"}
HALF_SIGNAL_REWARDS = "[{name: 'rewards_for_tests:letters_on_even_answers'}]"


def record_trained_batches(monkeypatch) -> list:
    """Every batch the colocated loop hands to train_on_batch, in order."""
    import grpo.training.loop as trainer_module

    real, seen = trainer_module.train_on_batch, []

    def recording(learner, batch, settings, info, *rest):  # rest: the PTX micro-batch
        seen.append(batch)
        return real(learner, batch, settings, info, *rest)

    monkeypatch.setattr(trainer_module, "train_on_batch", recording)
    return seen


def test_demo_recipe_trains_only_groups_whose_rewards_differ(tmp_path, monkeypatch):
    # The shipped model answers about 40% of the demo problems at the start: with G=4 and the answer reward
    # alone, some groups are all right or all wrong.
    monkeypatch.chdir(REPO)
    out, P, G = tmp_path / "demo", 4, 4
    trained = record_trained_batches(monkeypatch)
    cfg = load_config(REPO / "configs" / "demo-cpu.yaml", [
        "train.max_steps=3", f"train.prompts_per_step={P}", f"rollout.num_generations={G}",
        "train.micro_batch_size=16", "train.save_steps=3", "data.eval=null", f"train.output_dir={out}",
        "log.report_to=[]", "log.progress_bar=false", "log.plots=false", "rewards=[{name: answer_correct}]",
        "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=6"])
    train(cfg)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and len(trained) == 3
    assert all(DYNAMIC_KEYS <= set(r) for r in rows)
    assert sum(r["rollout/dynamic_groups_dropped"] for r in rows) > 0  # there was something to drop
    assert any(r["rollout/dynamic_rounds"] > 1 for r in rows)
    for row, batch in zip(rows, trained):
        assert len(batch.prompts) == P and batch.rewards.shape == (P * G,)  # exactly the configured size
        assert row["rollout/dynamic_prompts_drawn"] == P * row["rollout/dynamic_rounds"]
        flat = zero_spread_groups(batch.rewards, G)
        assert int(flat.sum()) == row["rollout/dynamic_groups_filled"] == 0, row  # every trained group differs
        assert row["zero_std_fraction"] == 0.0
        assert (batch.advantages.view(P, G) != 0).any(dim=1).all()


def test_resume_draws_the_same_rounds_as_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    overrides = {"train.max_steps": 4, "train.save_steps": 1, "train.prompts_per_step": 4, "train.micro_batch_size": 8,
                 "rewards": HALF_SIGNAL_REWARDS, "rollout.dynamic_sampling": True, "loss.beta": 0.0}
    a, _ = resume_matches_uninterrupted(tiny_model_dir, tmp_path, overrides, monkeypatch)
    assert sum(r["rollout/dynamic_groups_dropped"] for r in a) > 0 and any(r["rollout/dynamic_rounds"] > 1 for r in a)


def test_at_the_cap_a_run_fills_its_batch_with_zero_spread_groups_and_counts_them(tiny_model_dir, tmp_path):
    # A random model never answers right: every group is all -1, so every step runs to the cap and trains
    # on filler groups, whose advantages (and policy gradient) are zero.
    out = tmp_path / "flat"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{
        "train.max_steps": 2, "train.save_steps": 100, "rewards": "[{name: answer_correct}]", "loss.beta": 0.0,
        "rollout.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 3, "log.report_to": "[]"}))
    with pytest.warns(RuntimeWarning, match="filled with zero-spread groups"):
        train(cfg)
    rows = train_rows(out)
    for row in rows:
        assert row["rollout/dynamic_rounds"] == 3 and row["rollout/dynamic_cap_hit"] == 1.0
        assert row["rollout/dynamic_groups_filled"] == 2 and row["rollout/dynamic_groups_dropped"] == 6
        assert row["zero_std_fraction"] == 1.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0


def test_two_ranks_colocated_and_decoupled_run_the_same_rounds(tiny_model_dir, tmp_path):
    # Each rank fills its own batch (no collective inside the rounds, so ranks may run different numbers of
    # them); a decoupled sampler runs each trainer rank's rounds for its chunk with the same prompts and
    # seeds, so the first step's counts, rewards and loss agree. The decoupled run also has the sampler
    # correction on: with max_staleness 0 the sampler's weights are the trainer's, so every weight is 1
    # (up to float noise) and the loss must not move.
    common = {"rewards": HALF_SIGNAL_REWARDS, "rollout.dynamic_sampling": True, "loss.beta": 0.0,
              "train.max_steps": 1}
    colocated, decoupled = colocated_and_decoupled(tiny_model_dir, tmp_path, common, {
        "decoupled.trainer_ranks": 2, "loss.sampler_is_correction": True})
    a, b = train_rows(colocated)[0], train_rows(decoupled)[0]
    assert a["rollout/dynamic_groups_dropped"] > 0 and a["zero_std_fraction"] == 0.0
    assert b["sampler_is/weight_mean"] == pytest.approx(1.0, abs=1e-5) and b["sampler_is/logprob_diff"] < 1e-5
    for key in sorted(DYNAMIC_KEYS) + ["loss", "reward/mean", "reward/std", "advantage/abs_mean"]:
        assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
