"""Helpers of the reliability suite: a tiny run recipe, CLI invocations, run-folder snapshots.

Every test of the suite drives the real command line (``grpo.cli.main`` in-process, or ``python -m grpo`` in
a subprocess when a process must really be killed) on the session's tiny Qwen2 (``tiny_model_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

RELIABILITY_DIR = Path(__file__).resolve().parent
INTEGRATION_DIR = RELIABILITY_DIR.parent / "integration"  # rewards_for_tests (the `letters` reward)

# The smallest run that still exercises everything: 2 prompts x G=4 completions of <= 8 tokens a step,
# two micro-batches (so accumulation is used), a checkpoint every step, nothing but metrics.jsonl logged.
RECIPE = """\
# The reliability suite's recipe (model.name_or_path and train.output_dir come as overrides).
data:
  train: synthetic:seed=1,n=32
rollout:
  num_generations: 4
  max_completion_length: 8
optim:
  learning_rate: 1.0e-3
train:
  prompts_per_step: 2
  micro_batch_size: 4
  max_steps: 2
  save_steps: 1
  seed: 0
log:
  report_to: []
  progress_bar: false
  num_samples: 8
rewards:
  - {name: 'rewards_for_tests:letters'}
  - {name: answer_correct}
"""

TIMING_PREFIXES = ("time/", "tokens_per_s")


@contextmanager
def rewards_on_path():
    """Dotted-path rewards of the tests import in-process as a user's would (subprocesses get PYTHONPATH)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(INTEGRATION_DIR))
        patch.syspath_prepend(str(RELIABILITY_DIR))
        yield


def run_args(model_dir: Path, out: Path, **extra) -> list[str]:
    """``key=value`` overrides for a tiny run of ``model_dir`` into ``out``; ``extra`` adds or replaces."""
    values = {"model.name_or_path": model_dir, "train.output_dir": out, **extra}
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def cli_env() -> dict:
    """Environment of a ``python -m grpo`` subprocess: test rewards importable, one thread (so a
    subprocess run and its resumption reduce floats in the same order)."""
    path = os.pathsep.join([str(INTEGRATION_DIR), str(RELIABILITY_DIR), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def grpo_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "grpo", *map(str, args)]


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path: equal snapshots = byte-identical trees."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_rows(out: Path) -> list[dict]:
    return [r for r in metrics(out) if "loss" in r]


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def wait_until(condition, what: str, timeout: float = 180.0, proc=None) -> None:
    """Poll ``condition()`` every 50 ms; fail naming ``what`` after ``timeout`` s, or as soon as ``proc`` has
    exited with the condition still false (nothing will make it true then)."""
    deadline = time.time() + timeout
    while True:
        # Whether the process had exited is read before the condition: a process that logs its last step
        # and exits between the two reads is then seen with everything it wrote, not failed as "exited".
        exited = proc is not None and proc.poll() is not None
        if condition():
            return
        if exited:
            raise AssertionError(f"process exited with {proc.returncode} before {what}")
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def logged_steps(out: Path) -> int:
    """The number of training steps in metrics.jsonl (0 while it does not exist; a torn last line is ignored)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    count = 0
    for line in lines:
        try:
            count += "loss" in json.loads(line)
        except ValueError:
            pass
    return count
