"""`grpo train` with ``train.fsdp`` end to end, real processes on gloo: two FSDP2 ranks colocated and decoupled (2
trainer ranks + a sampler) give the same first step; the decoupled trainer publishes the weights its final/ holds
(full, and LoRA's gathered adapter); one rank killed with kill -9 and the run resumed ends on the uninterrupted
run's weights bit for bit; a 2-rank
checkpoint resumes on 3 ranks, and theirs on 1 (DCP reshards); LoRA with gradient checkpointing and CPU offload
trains its adapter only, and `grpo export` of its sharded checkpoint is its final/ merged; dynamic sampling (ranks
sampling different rounds) with bf16 units and the fused head, and PPO's critic, run on two FSDP2 ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import (
    SIGNAL_REWARDS,
    SMOKE,
    base_overrides,
    cli_env,
    colocated_and_decoupled,
    decoupled_overrides,
    free_port,
    grpo_cmd,
    train_rows,
    wait_until,
)
from safetensors.torch import load_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 6 prompts of 2 completions a step: whole groups on 1, 2 and 3 ranks
RUN = {"train.fsdp": True, "train.prompts_per_step": 6, "rollout.num_generations": 2, "train.micro_batch_size": 2,
       "rollout.max_completion_length": 8, "train.max_steps": 4, "train.save_steps": 1, "data.eval": None,
       "rewards": SIGNAL_REWARDS, "log.report_to": "[]"}


def torchrun(ranks: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "grpo", *map(str, args)]


def run(ranks: int, *args, timeout: float = 600) -> None:
    result = subprocess.run(torchrun(ranks, *args), env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "uninterrupted"
    run(2, "train", *base_overrides(tiny_model_dir, out, **RUN))
    return out


def test_two_fsdp_ranks_train_colocated_and_checkpoint_their_shards(tiny_model_dir, uninterrupted):
    rows = train_rows(uninterrupted)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in rows)
    initial, final = weights(tiny_model_dir), weights(uninterrupted / "final")  # final/: gathered, HF format
    assert set(initial) == set(final) and all(not torch.equal(initial[k], final[k]) for k in initial)
    checkpoints = uninterrupted / "checkpoints"
    # save_total_limit 2: the newest two checkpoints, each its shards beside it; no HF weights inside
    assert sorted(p.name for p in checkpoints.iterdir()) == ["fsdp-step-3", "fsdp-step-4", "step-3", "step-4"]
    assert sorted(p.name for p in (checkpoints / "fsdp-step-4").iterdir()) == [".metadata", "__0_0.distcp",
                                                                               "__1_0.distcp"]
    assert not list((checkpoints / "step-4").glob("*.safetensors"))


def _workers(launcher: subprocess.Popen) -> list[int]:
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def test_kill_9_one_rank_then_resume_ends_on_the_uninterrupted_weights(tiny_model_dir, uninterrupted, tmp_path):
    out = tmp_path / "killed"
    args = ["train", *base_overrides(tiny_model_dir, out, **RUN)]
    launcher = subprocess.Popen(torchrun(2, *args), env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (out / "checkpoints" / "step-2" / "trainer_state.json").is_file(), "checkpoint 2",
                   proc=launcher)
        workers = _workers(launcher)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert not (out / "final").exists()
    run(2, *args, "train.resume=true")
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]
    resumed, want = weights(out / "final"), weights(uninterrupted / "final")
    assert all(torch.equal(resumed[k], want[k]) for k in want), "resumed weights differ from the uninterrupted run's"


def test_a_two_rank_checkpoint_resumes_on_three_ranks_and_theirs_on_one(tiny_model_dir, uninterrupted, tmp_path):
    three, one = tmp_path / "three", tmp_path / "one"
    step3 = uninterrupted / "checkpoints" / "step-3"
    exported = tmp_path / "exported-3"
    subprocess.run(grpo_cmd("export", step3, exported), env=cli_env(), check=True, capture_output=True)
    # 3 ranks read the 2 ranks' shards of step 3 and train step 4; 1 rank reads the 3 ranks' step 4 and trains none
    run(3, "train", *base_overrides(tiny_model_dir, three, **RUN), f"train.resume_from={step3}")
    rows = train_rows(three)
    assert [r["step"] for r in rows] == [4] and rows[0]["grad_norm"] > 0
    after_step_3, after_step_4 = weights(exported), weights(three / "final")
    assert all(not torch.equal(after_step_3[k], after_step_4[k]) for k in after_step_3)
    run(1, "train", *base_overrides(tiny_model_dir, one, **RUN),
        f"train.resume_from={three / 'checkpoints' / 'step-4'}")
    assert train_rows(one) == []
    assert all(torch.equal(weights(one / "final")[k], after_step_4[k]) for k in after_step_4)


def test_lora_with_checkpointing_and_offload_trains_its_adapter_and_exports_merged(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    run(2, "train", *base_overrides(tiny_model_dir, out, **{
        **RUN, "train.max_steps": 2, "model.lora_r": 4, "model.gradient_checkpointing": True,
        "fsdp.cpu_offload": True, "optim.learning_rate": 1e-2}))
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())
    exported = tmp_path / "exported"
    subprocess.run(grpo_cmd("export", out / "checkpoints" / "step-2", exported), env=cli_env(), check=True,
                   capture_output=True)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert changed and all("proj" in k for k in changed)  # only the adapted linear layers moved


def test_two_fsdp_ranks_colocated_and_decoupled_give_the_same_first_step(tiny_model_dir, tmp_path):
    colocated, decoupled = colocated_and_decoupled(tiny_model_dir, tmp_path, {"train.fsdp": True, "train.max_steps": 2},
                                                   {"decoupled.trainer_ranks": 2})
    a, b = train_rows(colocated)[0], train_rows(decoupled)[0]
    for key in ("loss", "kl", "grad_norm", "reward/mean", "completion_length/mean"):
        assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert [r["step"] for r in train_rows(decoupled)] == [1, 2]
    assert (decoupled / "checkpoints" / "fsdp-step-2").is_dir()
    published, final = weights(decoupled / "weights" / "v2"), weights(decoupled / "final")
    assert set(published) == set(final) and all(torch.equal(published[k], final[k]) for k in final)


def test_dynamic_sampling_bf16_fused_head_and_ppos_critic_run_on_two_fsdp_ranks(tiny_model_dir, tmp_path):
    # Dynamic sampling: each rank samples as many rounds as its own groups need, on the gathered policy (no
    # collective there), then the update's micro-batch counts are made equal; bf16 units over fp32 shards; the
    # fused head calls the root's LM head outside the forward. PPO: the critic (DDP) beside the sharded policy.
    dynamic = tmp_path / "dynamic"
    run(2, "train", *base_overrides(tiny_model_dir, dynamic, **{
        **RUN, "train.max_steps": 2, "rollout.dynamic_sampling": True, "model.bf16": True,
        "train.fused_lm_head": True}))
    rows = train_rows(dynamic)
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    final = weights(dynamic / "final")
    assert all(t.dtype == torch.float32 for t in final.values())  # the fp32 shards are the master weights
    ppo = tmp_path / "ppo"
    run(2, "train", *base_overrides(tiny_model_dir, ppo, **{
        **RUN, "train.max_steps": 2, "algorithm.advantage_estimator": "gae", "critic.learning_rate": 1e-3}))
    rows = train_rows(ppo)
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert (ppo / "checkpoints" / "step-2" / "critic").is_dir()


def test_decoupled_lora_trainer_ranks_publish_the_gathered_adapter(tiny_model_dir, tmp_path):
    out = tmp_path / "decoupled-lora"
    result = subprocess.run(grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, out, **{
        "train.mode": "decoupled", "decoupled.trainer_ranks": 2, "train.fsdp": True, "train.max_steps": 2,
        "model.lora_r": 4, "optim.learning_rate": 1e-2})), env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in train_rows(out)] == [1, 2]
    published = load_file(out / "weights" / "v2" / "model.safetensors")
    final = load_file(out / "final" / "adapter_model.safetensors")
    assert set(published) == set(final) and all(torch.equal(published[k], final[k]) for k in final)
    assert any(v.abs().sum() > 0 for k, v in final.items() if "lora_B" in k)
