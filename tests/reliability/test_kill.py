"""Processes really killed (SIGKILL, no chance to clean up) and restarted with --resume: the run finishes,
each step's batch is trained once, and the result equals an uninterrupted run's."""

from __future__ import annotations

import random
import signal
import subprocess
import time

import pytest
import torch
from reliability_helpers import (
    cli_env,
    grpo_cmd,
    logged_steps,
    metrics,
    rewards_on_path,
    run_args,
    train_rows,
    wait_until,
    without_timings,
)
from safetensors.torch import load_file

from grpo.checkpoint import latest_checkpoint, load_checkpoint
from grpo.cli import main

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
STEPS = 12


def kill_at_random_point(out, args, rng: random.Random, after_steps: int) -> int:
    """Start ``grpo train ARGS``, SIGKILL it a seeded random time after it logged ``after_steps`` steps
    (a checkpoint is written every step, so the kill lands in sampling, the update or a save); returns
    the number of steps logged when it died."""
    proc = subprocess.Popen(grpo_cmd("train", *args), env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: logged_steps(out) >= after_steps, f"{after_steps} logged steps", proc=proc)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill: {proc.stderr.read()[-2000:]}"
    return logged_steps(out)


def test_kill_9_twice_at_random_points_then_resume_equals_uninterrupted(tiny_model_dir, recipe, tmp_path):
    rng = random.Random(20240607)
    extra = {"train.max_steps": STEPS, "train.save_total_limit": 2}
    reference = tmp_path / "uninterrupted"
    with rewards_on_path():
        assert main(["train", str(recipe), *run_args(tiny_model_dir, reference, **extra)]) == 0

    out = tmp_path / "killed"
    args = [recipe, *run_args(tiny_model_dir, out, **extra)]
    first = kill_at_random_point(out, args, rng, after_steps=rng.randint(1, 3))
    # Checkpoints are written to a temporary folder and renamed: the newest complete one loads, and it
    # is at most the step in flight behind what was logged.
    newest = latest_checkpoint(out)
    assert (int(newest.name.removeprefix("step-")) if newest else 0) >= first - 1
    # On a fast or idle machine the second kill may land after the last step was logged (during the final
    # save): that is a kill point too, and the resume below must still finish the run identically.
    kill_at_random_point(out, [*args, "--resume"], rng, after_steps=first + rng.randint(2, 4))
    with rewards_on_path():
        assert main(["train", *map(str, args), "--resume"]) == 0

    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step was lost or trained twice"
    assert [without_timings(r) for r in metrics(out)] == [without_timings(r) for r in metrics(reference)]
    a, b = load_file(reference / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((out / "checkpoints").glob(".tmp-*")), "a killed save's temporary folder was left behind"
    from transformers import AutoModelForCausalLM

    load_checkpoint(latest_checkpoint(out), AutoModelForCausalLM.from_pretrained(tiny_model_dir))  # loads
