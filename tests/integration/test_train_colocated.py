"""End-to-end colocated GRPO on a tiny random Qwen2 built in the test (saved, reloaded with from_pretrained)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import (
    REQUIRED_KEYS,
    SIGNAL_REWARDS,
    base_overrides,
    cli_env,
    grpo_cmd,
    read_metrics,
    resume_matches_uninterrupted,
)
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_full_finetune_changes_every_parameter_and_writes_outputs(tiny_model_dir, tmp_path):
    out = tmp_path / "full"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{"data.eval": "synthetic:seed=123,n=4",
                                                                   "rewards": SIGNAL_REWARDS, "log.plots": True}))
    result = train(cfg)
    initial = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    unchanged = [name for name in initial if torch.equal(initial[name], final[name])]
    assert not unchanged, f"parameters that never changed: {unchanged}"
    rows = read_metrics(out)
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert REQUIRED_KEYS <= set(train_rows[0]), REQUIRED_KEYS - set(train_rows[0])
    assert "reward/answer_correct" in train_rows[0] and "reward/format_think_answer" in train_rows[0]
    assert any("eval/accuracy" in r for r in rows) and result.eval_before is not None
    for name in ("config.yaml", "samples.jsonl", "plots/reward.png", "plots/accuracy.png", "plots/kl.png",
                 "plots/completion_length.png", "checkpoints/step-2", "checkpoints/step-3", "final"):
        assert (out / name).exists(), name
    assert any((out / "tensorboard").iterdir())


def test_lora_trains_adapter_and_leaves_base_untouched(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{"model.lora_r": 4, "train.max_steps": 2,
                                                                   "optim.lora_learning_rate": 1e-2,
                                                                   "rewards": SIGNAL_REWARDS}))
    train(cfg)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert not (out / "final" / "model.safetensors").exists()  # only the adapter is saved
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b), "every LoRA B matrix moved away from its zero init"
    # The base checkpoint on disk is the reference (adapter disabled): it must be what we loaded.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out / "final")
    base_state = base.state_dict()
    for name, tensor in peft_model.get_base_model().state_dict().items():
        clean = name.replace("base_layer.", "")
        if "lora_" not in name and clean in base_state:
            assert torch.equal(tensor, base_state[clean]), name


def test_reward_rises_on_an_easy_task(tiny_model_dir, tmp_path):
    out = tmp_path / "easy"
    cfg = load_config(None, base_overrides(
        tiny_model_dir, out, **{"train.max_steps": 20, "train.prompts_per_step": 4, "train.micro_batch_size": 32,
                                "rollout.num_generations": 8, "optim.learning_rate": 1e-2, "loss.beta": 0.0,
                                "train.save_steps": 100, "rewards": "[{name: 'rewards_for_tests:letters'}]"}))
    train(cfg)
    rewards = [r["reward/mean"] for r in read_metrics(out) if "reward/mean" in r]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Measured: about 0.6 -> 0.95 over 20 steps with this seed; a broken sign or mask stays near 0.6.
    assert last > first + 0.2, rewards


@pytest.mark.parametrize("mini_batches", [1, 2])  # 2: four updates a step, the schedule saved and restored per update
def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch, mini_batches):
    overrides = {"train.max_steps": 4, "train.save_steps": 1, "loss.num_iterations": 2, "data.eval": None,
                 "rewards": SIGNAL_REWARDS, "train.mini_batches": mini_batches}
    resume_matches_uninterrupted(tiny_model_dir, tmp_path, overrides, monkeypatch)


def test_mini_batches_train_every_parameter_and_step_the_schedule_per_update(tiny_model_dir, tmp_path):
    # 2 prompt groups a step, one per mini-batch, 2 passes: 4 updates a step, 8 in the run, over which the linear
    # schedule decays: step 2's first update is update 4 of 8, at half the peak rate (a schedule over the 2 steps'
    # num_iterations alone would be at 0 there).
    out = tmp_path / "mini"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{
        "train.mini_batches": 2, "loss.num_iterations": 2, "train.max_steps": 2, "optim.lr_scheduler_type": "linear",
        "loss.loss_type": "dapo", "data.eval": None, "rewards": SIGNAL_REWARDS}))
    train(cfg)
    initial = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert not [name for name in initial if torch.equal(initial[name], final[name])]
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-3, 0.5e-3])
    assert all(r["skipped_updates"] == 0 and r["ratio_mean"] != 1.0 for r in rows)


def test_kill_9_mid_run_loses_at_most_the_step_in_flight(tiny_model_dir, tmp_path):
    out = tmp_path / "killed"
    args = grpo_cmd("train", *base_overrides(
        tiny_model_dir, out, **{"train.max_steps": 30, "train.save_steps": 1, "log.report_to": "[]"}))
    proc = subprocess.Popen(args, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        done = [p for p in (out / "checkpoints").glob("step-*")] if (out / "checkpoints").exists() else []
        if len(done) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_logged = [r["step"] for r in read_metrics(out)]
    from grpo.run.checkpoint import latest_checkpoint

    saved = int(latest_checkpoint(out).name.split("-")[1])
    assert saved >= max(steps_logged) - 1  # a checkpoint every step: at most the step in flight is lost
    resumed = subprocess.run(args[:4] + ["--resume"] + args[4:], env=cli_env(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [r["step"] for r in read_metrics(out) if "reward/mean" in r]
    assert steps == list(range(1, 31))


def test_two_rank_torchrun_gives_each_rank_distinct_whole_groups(tiny_model_dir, tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not installed")
    out, log = tmp_path / "ddp", tmp_path / "prompts"
    env = cli_env()
    env["GRPO_TEST_PROMPT_LOG"] = str(log)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "grpo", "train", *base_overrides(
        tiny_model_dir, out, **{"train.max_steps": 2, "train.prompts_per_step": 4,
                                "rewards": "[{name: 'rewards_for_tests:record_prompts'}, {name: answer_correct}]",
                                # the run's rewards also score its evaluations: count training's calls only
                                "data.eval": None})]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = {}
    for rank in (0, 1):
        rows = [json.loads(line) for line in Path(f"{log}.{rank}").read_text().splitlines()]
        per_rank[rank] = rows
    for rank, rows in per_rank.items():
        # 2 steps x 2 prompts per rank x G=4: each question appears in whole groups of 4, contiguously.
        assert len(rows) == 2 * 2 * 4
        for start in range(0, len(rows), 4):
            assert len({r["question"] for r in rows[start:start + 4]}) == 1
    q0 = [per_rank[0][i]["question"] for i in range(0, 16, 4)]
    q1 = [per_rank[1][i]["question"] for i in range(0, 16, 4)]
    assert not set(q0) & set(q1), "ranks trained on the same prompts"
    assert [r["step"] for r in read_metrics(out) if "reward/mean" in r] == [1, 2]
    # log_metric values gathered over the ranks (as JSON bytes, never pickles): the mean over the ranks
    # that logged a name, so rank 1's own metric is not halved by rank 0's silence
    trained = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [(r["test/rank"], r["test/rank1_only"]) for r in trained] == [(0.5, 3.0), (0.5, 3.0)]


def test_bf16_full_fine_tuning_keeps_fp32_master_weights_so_small_updates_are_not_lost(tiny_model_dir, tmp_path):
    # model.bf16 without DeepSpeed: fp32 master weights, bf16 compute (autocast). A learning rate far
    # below a bf16 weight's resolution (~2^-8 of it) must still move (nearly) every weight; with bf16
    # weights, as before, almost none moved.
    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.bf16=true", "optim.learning_rate=1e-6",
        "optim.max_grad_norm=null", "data.train=synthetic:seed=1,n=64", "rollout.num_generations=4",
        "rollout.max_completion_length=12", "train.prompts_per_step=2", "train.micro_batch_size=8",
        "train.max_steps=1", "train.device=cpu", f"train.output_dir={out}", "log.report_to=[]",
        "log.progress_bar=false", "log.plots=false", "rewards=[{name: 'rewards_for_tests:characters_reward'}]"])
    train(cfg)
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(out / "final" / "model.safetensors")
    # Compared in the saved dtype, so that a bf16 copy of unchanged weights does not count as moved.
    moved = sum(int((after[k] != before[k].to(after[k].dtype)).sum()) for k in before)
    total = sum(t.numel() for t in before.values())
    assert moved / total > 0.5, f"only {moved}/{total} weights moved"
    assert all(t.dtype == torch.float32 for t in after.values())  # the master weights are what is saved

