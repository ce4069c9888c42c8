"""Processes really killed (SIGKILL, no chance to clean up) and restarted with --resume: the run finishes,
each step's batch is trained once, and the result equals an uninterrupted run's."""

from __future__ import annotations

import random
import signal
import subprocess
import tempfile
import time

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

from grpo.cli import main
from grpo.run.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
STEPS = 12
FIRST_KILL_AFTER = (1, 3)  # the first kill waits for this many logged steps (a seeded draw in this range)
SECOND_KILL_LATER = (2, 4)  # the second waits for this many steps more than the first run logged
KILL_WINDOW = 2  # a kill lands at the latest when this many steps more are logged
MAX_DELAY_S = 0.6  # a kill lands a random 0..MAX_DELAY_S s after its wait ends (unless the window closes first)


def kill_at_random_point(out, args, rng: random.Random, after_steps: int, by_steps: int) -> int:
    """Start ``grpo train ARGS``; once it logged ``after_steps`` steps, SIGKILL it a seeded random time later,
    and at the latest when it logged ``by_steps`` (a checkpoint is written every step, so the kill lands in
    sampling, the update or a save). Returns the number of steps logged when it died.

    A step of the tiny run takes ~0.1 s on an idle machine, so a delay alone could carry the kill past the
    last step and the run could exit first: ``by_steps <= STEPS`` keeps the kill inside the run (at
    ``STEPS``, in the final save, which takes far longer than the 10 ms between two looks at the log).
    """
    assert 1 <= after_steps <= by_steps <= STEPS, (after_steps, by_steps)
    # stderr to a file: a pipe nobody reads while the run goes on could fill up and stall the run.
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(grpo_cmd("train", *args), env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True)
        try:
            wait_until(lambda: logged_steps(out) >= after_steps, f"{after_steps} logged steps", proc=proc)
            deadline = time.monotonic() + rng.uniform(0.0, MAX_DELAY_S)
            while time.monotonic() < deadline and logged_steps(out) < by_steps and proc.poll() is None:
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)  # a no-op if it has exited: the assertion below says so
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        stderr.seek(0)
        assert proc.returncode == -signal.SIGKILL, (
            f"the run exited with {proc.returncode} before the kill, {logged_steps(out)} steps logged "
            f"(the kill was due by {by_steps}): {stderr.read()[-2000:]}")
    return logged_steps(out)


def test_kill_9_twice_at_random_points_then_resume_equals_uninterrupted(tiny_model_dir, recipe, tmp_path):
    rng = random.Random(20240607)
    extra = {"train.max_steps": STEPS, "train.save_total_limit": 2}
    reference = tmp_path / "uninterrupted"
    with rewards_on_path():
        assert main(["train", str(recipe), *run_args(tiny_model_dir, reference, **extra)]) == 0

    out = tmp_path / "killed"
    args = [recipe, *run_args(tiny_model_dir, out, **extra)]
    after = rng.randint(*FIRST_KILL_AFTER)
    first = kill_at_random_point(out, args, rng, after_steps=after, by_steps=after + KILL_WINDOW)
    # Checkpoints are written to a temporary folder and renamed: the newest complete one loads, and it
    # is at most the step in flight behind what was logged.
    newest = latest_checkpoint(out)
    assert (int(newest.name.removeprefix("step-")) if newest else 0) >= first - 1
    # The resumed run must log a step the killed one did not before the second kill (until it trims
    # metrics.jsonl to its checkpoint, the log still counts the first run's `first` steps).
    assert first < STEPS, (f"the first kill, due by step {after + KILL_WINDOW}, landed after all {STEPS} steps "
                           f"were logged: no step is left for a second kill")
    # The second kill waits for steps the first run did not log, but never for more than the run has: when
    # the first kill landed late, it lands once the last step is logged (in the final save), a kill point
    # too, after which the resume below must still finish the run identically.
    after = min(first + rng.randint(*SECOND_KILL_LATER), STEPS)
    kill_at_random_point(out, [*args, "--resume"], rng, after_steps=after, by_steps=min(after + KILL_WINDOW, STEPS))
    with rewards_on_path():
        assert main(["train", *map(str, args), "--resume"]) == 0

    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step was lost or trained twice"
    assert [without_timings(r) for r in read_metrics(out)] == [without_timings(r) for r in read_metrics(reference)]
    a, b = load_file(reference / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((out / "checkpoints").glob(".tmp-*")), "a killed save's temporary folder was left behind"
    from transformers import AutoModelForCausalLM

    load_checkpoint(latest_checkpoint(out), AutoModelForCausalLM.from_pretrained(tiny_model_dir))  # loads
