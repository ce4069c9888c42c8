"""Partial rollouts end to end (issue 45; ``decoupled.partial_rollouts``), with real processes: groups carried over
from one chunk to the next are trained once and only once across a trainer ``kill -9`` + ``--resume``, with
weights loaded per chunk and in flight. The bookkeeping without processes: tests/test_partial_rollouts.py."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from run_helpers import (
    REPO,
    SMOKE,
    cli_env,
    decoupled_overrides,
    each_batch_once,
    free_port,
    grpo_cmd,
    logged_steps,
    start,
    stop_all,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def trained_groups(rows: list[dict]) -> list[str]:
    return [g for r in rows for g in r["groups"].split()]


def start_trainer(args: list, ranks: int, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """The trainer role, under torchrun in a session of its own with several ranks (so that a kill reaches them)."""
    if ranks == 1:
        return start("trainer", SMOKE, *args, stderr=stderr)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
         str(free_port()), "-m", "grpo", "trainer", SMOKE, *map(str, args)], env=cli_env(),
        stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)


def kill_trainer(trainer: subprocess.Popen, ranks: int) -> None:
    """kill -9 of the trainer, every rank of it."""
    if trainer.poll() is None:
        if ranks == 1:
            trainer.send_signal(signal.SIGKILL)
        else:
            os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()


@pytest.mark.parametrize("weight_update, ranks", [("per_chunk", 1), ("in_flight", 1), ("per_chunk", 2)])
def test_carried_groups_are_trained_once_across_a_trainer_kill_and_resume(tmp_path, weight_update, ranks):
    # save_steps 2 and a kill after step 3 or later: the steps since the last checkpoint were acknowledged
    # provisionally, so the sampler resends their chunks; its carried-over groups live on in its memory. The final
    # run trains every group id at most once, and no group trained before the kill in a checkpointed step again.
    # With 2 trainer ranks a step's groups (two chunks) are split over them as evenly as whole groups allow.
    from grpo.run.checkpoint import latest_checkpoint

    out, steps = tmp_path / "run", 8
    # The shipped model on one- to three-step problems: completions of widely varying lengths, so groups finish
    # in different chunks (a random model's rows all run to max_completion_length, ending together).
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64,
        "train.max_steps": steps, "train.save_steps": 2, "train.mode": "decoupled", "train.max_staleness": 1,
        "rollout.engine": "hf", "decoupled.partial_rollouts": True, "decoupled.partial_token_budget": 8,
        "decoupled.weight_update": weight_update, "decoupled.inflight_check_tokens": 2,
        "decoupled.trainer_ranks": ranks, "optim.learning_rate": 1e-5})
    trainer, sampler = start_trainer(args, ranks), start("sampler", SMOKE, *args, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: logged_steps(out) >= 3, "3 logged steps", timeout=300, proc=trainer)
        kill_trainer(trainer, ranks)
        assert trainer.returncode == -signal.SIGKILL, f"the trainer exited with {trainer.returncode} before the kill"
        state = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())
        checkpointed = set(state["trained_group_ids"])
        assert checkpointed, "the checkpoint lists no trained group"
        trainer = start_trainer([*args, "train.resume=true"], ranks, stderr=subprocess.PIPE)
        _, err = trainer.communicate(timeout=400)
        assert trainer.returncode == 0, err[-3000:]
        sampler.wait(timeout=120)
        assert sampler.returncode == 0
    finally:
        kill_trainer(trainer, ranks)
        stop_all(sampler)
    rows = each_batch_once(out, steps)
    groups = trained_groups(rows)
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    assert checkpointed == set(trained_groups([r for r in rows if r["step"] <= state["step"]]))
    assert not checkpointed & set(trained_groups([r for r in rows if r["step"] > state["step"]]))
    carried = [r for r in rows if any(g.split("#")[0] not in r["batch_id"].split(",") for g in r["groups"].split())]
    assert carried, "no step trained a group carried over from an earlier chunk"
    assert any(r["rollout/partial_kv_reused_tokens"] > 0 for r in rows), "no carried row continued from its keys/values"
    for row in rows:
        assert row["rollout/partial_groups_sent"] * ranks == len(row["groups"].split()) >= ranks  # a chunk's mean
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0  # max_staleness 1, per token


def test_two_trainer_ranks_and_two_samplers_train_every_carried_group_once(tmp_path):
    # `grpo train` starts the trainer under torchrun with 2 ranks and 2 samplers. A step's two chunks hold a varying
    # number of whole groups, split over the ranks as evenly as whole groups allow (an odd count unevenly, each
    # rank's loss scaled to its share: tests/test_uneven_ranks.py); the run must finish with each group once.
    out, steps = tmp_path / "run", 5
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64,
        "train.max_steps": steps, "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf",
        "decoupled.trainer_ranks": 2, "decoupled.num_samplers": 2, "decoupled.partial_rollouts": True,
        "decoupled.partial_token_budget": 8, "train.micro_batch_size": 4, "optim.learning_rate": 1e-5})
    result = subprocess.run(grpo_cmd("train", SMOKE, *args), env=cli_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, steps)
    groups = trained_groups(rows)
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    for row in rows:
        sent = len(row["groups"].split())
        assert sent >= 2 and len(row["batch_id"].split(",")) == 2  # two chunks a step, each at least one group
        assert row["rollout/partial_groups_sent"] == pytest.approx(sent / 2)  # averaged over the step's chunks
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def test_deepspeed_zero2_trainer_ranks_train_uneven_steps(tmp_path):
    # Under DeepSpeed a rank with fewer groups runs zero-gradient micro-batches to match the other's count (ZeRO-2
    # reduces in every backward) and each update ends at the learner's boundary, not after DeepSpeed's fixed count
    # (the update against one process: tests/test_uneven_deepspeed.py). `grpo train` must finish with each group
    # trained once and every step's update applied.
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (make install installs it)")
    out, steps = tmp_path / "run", 4
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64,
        "train.max_steps": steps, "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf",
        "decoupled.trainer_ranks": 2, "decoupled.partial_rollouts": True, "decoupled.partial_token_budget": 8,
        "train.deepspeed": REPO / "configs" / "ds_zero2.json", "train.prompts_per_step": 6, "train.micro_batch_size": 4,
        "optim.learning_rate": 1e-5})  # micro-batches of one group, chunks of 3 prompts
    result = subprocess.run(grpo_cmd("train", SMOKE, *args), env=cli_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, steps)
    groups = trained_groups(rows)
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    for row in rows:
        assert len(row["groups"].split()) >= 2 and math.isfinite(row["loss"])
        assert math.isfinite(row["grad_norm"]) and row["skipped_updates"] == 0  # DeepSpeed stepped each update
    # the seed's first step holds 3 groups (its chunks were sampled with the initial weights): 2 micro-batches on
    # rank 0 against 1 (+ 1 of padding) on rank 1
    assert any(len(r["groups"].split()) % 2 for r in rows), "no step split its groups unevenly over the ranks"
