"""PPO (algorithm.advantage_estimator: gae) end to end on a tiny random Qwen2: the critic trains beside
the policy, is checkpointed and resumed with it, and runs data-parallel under torchrun."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import (
    REQUIRED_KEYS,
    SIGNAL_REWARDS,
    base_overrides,
    cli_env,
    read_metrics,
    resume_matches_uninterrupted,
)
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PPO = {"algorithm.advantage_estimator": "gae", "rewards": SIGNAL_REWARDS, "critic.learning_rate": 1e-3}
CRITIC_KEYS = {"loss/value", "critic/value_mean", "critic/return_mean", "critic/explained_variance", "critic/lr",
               "critic/grad_norm", "critic/value_clip_fraction", "critic/skipped_updates"}


def test_ppo_trains_policy_and_every_critic_parameter_and_checkpoints_the_critic(tiny_model_dir, tmp_path):
    out = tmp_path / "ppo"
    train(load_config(None, base_overrides(tiny_model_dir, out, **PPO, **{"train.max_steps": 3, "log.report_to": "[]"})))
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (REQUIRED_KEYS | CRITIC_KEYS) <= set(rows[0]), (REQUIRED_KEYS | CRITIC_KEYS) - set(rows[0])
    assert all(r["critic/lr"] == 1e-3 and r["critic/grad_norm"] > 0 and r["critic/skipped_updates"] == 0 for r in rows)
    assert rows[0]["critic/value_mean"] == 0.0  # a new head starts at zero
    assert rows[-1]["critic/value_mean"] != 0.0
    initial = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert not [k for k in initial if torch.equal(initial[k], final[k])], "the policy did not train"
    critic = out / "checkpoints" / "step-3" / "critic"
    body = load_file(critic / "model.safetensors")
    assert not [k for k in body if torch.equal(body[k], initial["model." + k])], "critic body parameters never moved"
    head = load_file(critic / "value_head.safetensors")
    assert head["weight"].abs().sum() > 0 and (critic / "optimizer.pt").is_file() and (critic / "scheduler.pt").is_file()


def test_ppo_resume_equals_uninterrupted_with_the_critics_state(tiny_model_dir, tmp_path, monkeypatch):
    # The critic's weights, optimizer and schedule must come back: its values feed the next step's
    # advantages, so a critic restarted from scratch would change every metric of steps 3-4.
    overrides = {**PPO, "train.max_steps": 4, "train.save_steps": 1, "loss.num_iterations": 2, "data.eval": None,
                 "log.report_to": "[]", "critic.lr_scheduler_type": "cosine"}
    resume_matches_uninterrupted(tiny_model_dir, tmp_path, overrides, monkeypatch, same_weights=False)
    full, part = tmp_path / "full", tmp_path / "part"
    head_a = load_file(full / "checkpoints" / "step-4" / "critic" / "value_head.safetensors")
    head_b = load_file(part / "checkpoints" / "step-4" / "critic" / "value_head.safetensors")
    assert all(torch.equal(head_a[k], head_b[k]) for k in head_a)


def test_ppo_resume_from_a_checkpoint_without_a_critic_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "grpo-then-ppo"
    common = {"train.max_steps": 1, "log.report_to": "[]", "rewards": SIGNAL_REWARDS}
    train(load_config(None, base_overrides(tiny_model_dir, out, **common)))
    from grpo.run.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="saved without a critic"):
        train(load_config(None, base_overrides(tiny_model_dir, out, **{**common, **PPO, "train.max_steps": 2})
                          + ["train.resume=true"]))


def test_ppo_with_one_completion_per_prompt_and_the_kl_in_the_reward(tiny_model_dir, tmp_path):
    # G = 1 (no group, the critic is the baseline) and r_t = -beta * KL_t: the run needs old log-probs
    # from the rollout for the KL and puts no KL in the loss.
    out = tmp_path / "g1"
    train(load_config(None, base_overrides(tiny_model_dir, out, **PPO, **{
        "rollout.num_generations": 1, "train.prompts_per_step": 4, "train.max_steps": 2, "log.report_to": "[]",
        "algorithm.kl_penalty": "reward", "loss.beta": 0.1, "algorithm.lam": 1.0})))
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["advantage/abs_mean"] > 0 for r in rows)  # G = 1 yet a signal: the critic's baseline
    assert rows[1]["kl"] > 0  # the policy moved away from the reference after step 1


def test_two_rank_torchrun_ppo(tiny_model_dir, tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not installed")
    out = tmp_path / "ddp"
    cmd = [str(torchrun if torchrun.exists() else shutil.which("torchrun")), "--nproc_per_node", "2",
           "--master_port", "29541", "-m", "grpo", "train",
           *base_overrides(tiny_model_dir, out, **PPO, **{"train.max_steps": 2, "train.prompts_per_step": 4,
                                                          "train.save_steps": 2, "log.report_to": "[]"})]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and CRITIC_KEYS <= set(rows[0])
    assert (out / "checkpoints" / "step-2" / "critic" / "value_head.safetensors").is_file()
