"""Helpers shared by the integration and reliability suites: overrides of a tiny run, the command line in a
subprocess, the tests' reward files on the path, reading a run's metrics, and the runs several test files
compare (an interrupted-and-resumed run, a colocated run beside a decoupled one).

A plain module, not a test module: pytest puts tests/integration on ``sys.path`` for the modules in it
(``rootdir``-based "prepend" imports, no ``__init__.py``), and tests/reliability/conftest.py puts it there
for the reliability suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transport_helpers import free_port  # tests/ is on sys.path too (tests/conftest.py)

from grpo.config import load_config
from grpo.run.tracking import METRICS_FILE
from grpo.run.tracking import read_metrics as read_metrics_file
from grpo.training.colocated import train

INTEGRATION_DIR = Path(__file__).resolve().parent
RELIABILITY_DIR = INTEGRATION_DIR.parent / "reliability"
REPO = INTEGRATION_DIR.parents[1]
SMOKE = str(REPO / "configs" / "smoke-cpu.yaml")
# The folders of the tests' dotted-path reward files: rewards_for_tests (letters, zero, ...) and
# rewards_for_reliability (rewards that misbehave).
REWARD_DIRS = (INTEGRATION_DIR, RELIABILITY_DIR)

REQUIRED_KEYS = {
    "step", "reward/mean", "reward/std", "accuracy", "format_rate", "kl", "loss", "clip_fraction", "entropy",
    "completion_length/mean", "truncated_fraction", "zero_std_fraction", "learning_rate", "grad_norm",
    "time/rollout_s", "time/train_s", "time/step_s", "tokens_per_s",
}
# A random model fails answer and format alike (no signal); the letters reward varies within groups.
SIGNAL_REWARDS = "[{name: 'rewards_for_tests:letters'}, {name: answer_correct}, {name: format_think_answer}]"
DECOUPLED_REWARDS = "[{name: 'rewards_for_tests:letters'}, {name: answer_correct}]"
TIMING_PREFIXES = ("time/", "tokens_per_s")


# ---------------------------------------------------------------- overrides


def as_overrides(values: dict) -> list[str]:
    """``key=value`` command-line overrides of ``values`` (None written as ``null``)."""
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def base_overrides(model_dir: Path, out: Path, **extra) -> list[str]:
    """A 3-step colocated run of ``model_dir`` into ``out`` (checkpoint at step 2, TensorBoard on, no plots);
    ``extra`` adds or replaces keys."""
    return as_overrides({
        "model.name_or_path": str(model_dir),
        "data.train": "synthetic:seed=1,n=64",
        "rollout.num_generations": 4,
        "rollout.max_completion_length": 12,
        "train.prompts_per_step": 2,
        "train.micro_batch_size": 4,
        "train.max_steps": 3,
        "train.save_steps": 2,
        "train.output_dir": str(out),
        "train.seed": 0,
        "optim.learning_rate": 1e-3,
        "log.report_to": "[tensorboard]",
        "log.progress_bar": False,
        "log.plots": False,  # matplotlib's import and five PNGs: seconds a run; the tests that read plots ask
        **extra,
    })


def decoupled_overrides(model_dir: Path, out: Path, **extra) -> list[str]:
    """A 3-step run with its own free ``decoupled.address`` (colocated unless ``train.mode`` says otherwise)."""
    return as_overrides({
        "model.name_or_path": model_dir, "data.train": "synthetic:seed=1,n=64", "data.eval": None,
        "rollout.num_generations": 4, "rollout.max_completion_length": 10, "train.prompts_per_step": 4,
        "train.micro_batch_size": 8, "train.max_steps": 3, "train.save_steps": 10, "train.output_dir": out,
        "train.seed": 0, "optim.learning_rate": 1e-3, "log.report_to": "[]", "log.progress_bar": False,
        "log.plots": False, "rewards": DECOUPLED_REWARDS, "decoupled.address": f"tcp://127.0.0.1:{free_port()}",
        "decoupled.peer_timeout_s": 120,
        **extra,
    })


# ---------------------------------------------------------------- the tests' rewards, the command line


@contextmanager
def rewards_on_path():
    """Dotted-path rewards of the tests import in-process as a user's would (subprocesses get PYTHONPATH)."""
    with pytest.MonkeyPatch.context() as patch:
        for folder in REWARD_DIRS:
            patch.syspath_prepend(str(folder))
        yield


def cli_env() -> dict:
    """Environment of a ``python -m grpo`` subprocess: the tests' rewards importable, the caller's PYTHONPATH
    kept (a checkout tested with PYTHONPATH=src beside another's editable install must run its own grpo in
    the children too), one thread (so a subprocess run and its resumption reduce floats in the same order)."""
    path = os.pathsep.join([*map(str, REWARD_DIRS), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def grpo_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "grpo", *map(str, args)]


def start(*args, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """``python -m grpo ARGS`` as its own process (output discarded; stderr piped when asked)."""
    return subprocess.Popen(grpo_cmd(*args), env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def stop_all(*procs) -> None:
    """Kill (and reap) every process of ``procs`` still running; None entries are skipped."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- metrics


def read_jsonl(path: Path) -> list[dict]:
    """The records of a run's JSON-lines file (metrics.jsonl, samples.jsonl), read with grpo's own reader.
    That reader skips a torn last line (a killed write, which a resumed run drops); the runs read here have
    stopped writing, so a last line without its newline is an error (as parsing every line was), not skipped."""
    rows = read_metrics_file(path)
    data = Path(path).read_bytes()
    assert not data.strip() or data.endswith(b"\n"), f"{path}: a torn last line"
    return rows


def read_metrics(out: Path) -> list[dict]:
    """The rows of the run folder ``out``'s metrics.jsonl (see ``read_jsonl``)."""
    return read_jsonl(Path(out) / METRICS_FILE)


def train_rows(out: Path) -> list[dict]:
    """The training steps' rows (eval rows left out)."""
    return [r for r in read_metrics(out) if "loss" in r]


def logged_steps(out: Path) -> int:
    """The number of training steps in metrics.jsonl while a run may be writing it (0 while it does not exist;
    a torn last line is ignored)."""
    try:
        rows = read_metrics_file(Path(out) / METRICS_FILE)
    except FileNotFoundError:
        return 0
    return sum("loss" in r for r in rows)


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def each_batch_once(out: Path, steps: int) -> list[dict]:
    """The run's step rows, checked: steps 1..steps once each, every batch id once."""
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    ids = [r["batch_id"] for r in rows]
    assert len(set(ids)) == len(ids), f"a batch was trained twice: {ids}"
    return rows


# The shipped model on one- to three-step problems (completions of spread lengths, so groups are carried from chunk to
# chunk), decoupled with in-flight updates and partial rollouts of 8 tokens a round
PARTIAL_IN_FLIGHT = {
    "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64, "train.mode": "decoupled",
    "train.max_staleness": 1, "decoupled.weight_update": "in_flight", "decoupled.partial_rollouts": True,
    "decoupled.partial_token_budget": 8}


def partial_in_flight_run(model_dir: Path, out: Path, steps: int, **settings) -> list[dict]:
    """The step rows of a decoupled `grpo train` (PARTIAL_IN_FLIGHT and ``settings``) that exited 0, checked: each
    batch and each group trained once."""
    args = decoupled_overrides(model_dir, out, **{**PARTIAL_IN_FLIGHT, "train.max_steps": steps, **settings})
    result = subprocess.run(grpo_cmd("train", SMOKE, *args), env=cli_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, steps)
    groups = [g for r in rows for g in r["groups"].split()]
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    return rows


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


# ---------------------------------------------------------------- runs compared


def interrupt_at_third_update(model_dir, out, overrides: dict, monkeypatch) -> None:
    """Train into ``out`` and press Ctrl-C in the third update (the trainer saves step 2 and re-raises)."""
    import grpo.training.loop as trainer_module

    real = trainer_module.train_on_batch
    calls = {"n": 0}

    def interrupt_at_third_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_on_batch", interrupt_at_third_step)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, base_overrides(model_dir, out, **overrides)))
    monkeypatch.setattr(trainer_module, "train_on_batch", real)


def resume_matches_uninterrupted(model_dir, tmp_path, overrides: dict, monkeypatch,
                                 same_weights: bool = True) -> tuple[list[dict], list[dict]]:
    """Run ``overrides`` for 4 steps (``train.max_steps: 4``, ``save_steps: 1``) uninterrupted
    (``tmp_path/full``) and interrupted in step 3 then resumed (``tmp_path/part``); assert every metric but
    the timings (and, with ``same_weights``, the final weights) agree; return both runs' metrics."""
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(None, base_overrides(model_dir, full, **overrides)))
    # Interrupt (Ctrl-C) in step 3: a checkpoint of step 2 is written, then resume to the end.
    interrupt_at_third_update(model_dir, part, overrides, monkeypatch)
    assert [r["step"] for r in read_metrics(part)] == [1, 2]
    train(load_config(None, base_overrides(model_dir, part, **overrides) + ["train.resume=true"]))
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for row_a, row_b in zip(a, b):
        for key, value in row_a.items():
            if not key.startswith(TIMING_PREFIXES):
                assert value == pytest.approx(row_b[key], abs=1e-6, rel=0), (row_a["step"], key)
    if same_weights:
        final_a = load_file(full / "final" / "model.safetensors")
        final_b = load_file(part / "final" / "model.safetensors")
        assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    return a, b


def colocated_and_decoupled(model_dir, tmp_path, common: dict, decoupled_extra: dict) -> tuple[Path, Path]:
    """The same settings run colocated over 2 torchrun ranks and in decoupled mode; both run folders."""
    colocated = tmp_path / "colocated"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "grpo", "train", SMOKE, *decoupled_overrides(model_dir, colocated, **common)]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    decoupled = tmp_path / "decoupled"
    cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(model_dir, decoupled, **common, **{
        "train.mode": "decoupled", **decoupled_extra}))
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return colocated, decoupled
