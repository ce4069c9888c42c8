"""Ctrl-C: a checkpoint of the last finished step, exit 130, and a resumed run equal to an uninterrupted one,
wherever in a step the interrupt lands."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch
from reliability_helpers import run_args
from run_helpers import (
    cli_env,
    grpo_cmd,
    logged_steps,
    read_metrics,
    rewards_on_path,
    train_rows,
    wait_until,
    without_timings,
)
from safetensors.torch import load_file

import grpo.training.colocated as colocated_module
import grpo.training.loop as loop_module
from grpo.cli import main
from grpo.run.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
TWO_PASSES = {"train.max_steps": 4, "loss.num_iterations": 2}  # two updates per step: a step is not atomic


def test_sigterm_to_a_two_rank_run_stops_every_rank_after_one_step_and_resume_continues(tiny_model_dir, recipe,
                                                                                          tmp_path):
    # torchrun forwards SIGTERM to both ranks, which reach it at different points of a step: they agree to
    # stop after the same finished step (a rank stopping alone would leave the other in a collective).
    import sys

    from transport_helpers import free_port

    out = tmp_path / "run"

    def torchrun(*args) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m", "grpo", "train", str(recipe), *args]

    args = run_args(tiny_model_dir, out, **{"train.max_steps": 200, "train.save_steps": 1000})
    proc = subprocess.Popen(torchrun(*args), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two logged steps", proc=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "every rank stops after this step" in err, err[-3000:]
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None, err[-3000:]
    saved = int(checkpoint.name.removeprefix("step-"))
    assert saved == logged_steps(out), "the checkpoint is of the last logged (finished) step"
    result = subprocess.run(torchrun(*run_args(tiny_model_dir, out, **{"train.max_steps": saved + 2}), "--resume"),
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in train_rows(out)] == list(range(1, saved + 3))


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_writes_a_checkpoint_exits_130_and_resume_finishes(tiny_model_dir, recipe, tmp_path, stop):
    # SIGTERM (what SLURM and torchrun send before a kill) is handled as Ctrl-C is
    out = tmp_path / "run"
    args = run_args(tiny_model_dir, out, **{"train.max_steps": 200, "train.save_steps": 1000})
    proc = subprocess.Popen(grpo_cmd("train", recipe, *args), env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two logged steps", proc=proc)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "grpo: interrupted" in err
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None, "Ctrl-C wrote no checkpoint"
    saved = int(checkpoint.name.removeprefix("step-"))
    assert saved == logged_steps(out), "the checkpoint is of the last logged (finished) step"
    assert main(["train", str(recipe), *run_args(tiny_model_dir, out, **{"train.max_steps": saved + 2}),
                 "--resume"]) == 0
    assert [r["step"] for r in train_rows(out)] == list(range(1, saved + 3))


def _signal_at_step(real, step_of_call: dict, at_step: int):
    """``real`` wrapped to deliver a real SIGINT to this process on the call made during ``at_step``."""
    def wrapper(*args, **kwargs):
        step_of_call["n"] += 1
        if step_of_call["n"] == at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    wrapper.__wrapped__ = real
    return wrapper


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    with rewards_on_path():
        assert main(["train", str(recipe), *run_args(tiny_model_dir, out, **TWO_PASSES)]) == 0
    return out


# Where in step 3 Ctrl-C lands: while sampling (the weights are still those of step 2), after the update
# (the step must then be finished and saved as step 3: saving the updated weights as step 2 would train
# its batch twice after resuming), or while its checkpoint is being written.
@pytest.mark.parametrize("module,where", [(colocated_module, "rank_experience"), (loop_module, "step_metrics"),
                                          (loop_module, "save_run_checkpoint")])
def test_ctrl_c_anywhere_in_a_step_then_resume_equals_uninterrupted(tiny_model_dir, recipe, tmp_path, monkeypatch,
                                                                    uninterrupted, module, where):
    out = tmp_path / "run"
    args = ["train", str(recipe), *run_args(tiny_model_dir, out, **TWO_PASSES)]
    monkeypatch.setattr(module, where, _signal_at_step(getattr(module, where), {"n": 0}, 3))
    assert main(args) == 130
    monkeypatch.setattr(module, where, getattr(module, where).__wrapped__)
    saved = latest_checkpoint(out)
    assert saved is not None
    assert [r["step"] for r in train_rows(out)] == list(range(1, int(saved.name.removeprefix("step-")) + 1))
    assert main([*args, "--resume"]) == 0

    assert ([without_timings(r) for r in read_metrics(out)]
            == [without_timings(r) for r in read_metrics(uninterrupted)])
    a, b = load_file(uninterrupted / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
