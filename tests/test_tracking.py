"""grpo.run.tracking: JSON-lines content, NaN handling, resume truncation, torn lines, trackers."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from grpo.run.tracking import MetricsLogger, json_safe, read_metrics


def lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_metrics_and_samples_are_json_lines(tmp_path):
    with MetricsLogger(tmp_path, [], {}) as logger:
        logger.log(1, {"loss": 0.5, "reward/mean": 1.0, "count": 3})
        logger.log(2, {"loss": torch.tensor(0.25), "kl": float("nan"), "x": float("inf")})
        logger.log_samples(2, [{"prompt": "1+1=", "completion": "<answer>2</answer> ✓", "reward": 1.0}])
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "reward/mean": 1.0, "count": 3},
        {"step": 2, "loss": 0.25, "kl": None, "x": None},  # NaN/inf -> null, never a bare NaN token
    ]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text() and "Infinity" not in (
        tmp_path / "metrics.jsonl").read_text()
    assert lines(tmp_path / "samples.jsonl") == [
        {"step": 2, "prompt": "1+1=", "completion": "<answer>2</answer> ✓", "reward": 1.0}]
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["kl"] is None


def test_json_safe_recurses():
    value = {"a": [1.0, float("-inf"), (2, float("nan"))], 3: torch.tensor([1.5, 2.5])}
    assert json_safe(value) == {"a": [1.0, None, [2, None]], "3": [1.5, 2.5]}


def test_step_key_in_metrics_is_rejected(tmp_path):
    with MetricsLogger(tmp_path, [], {}) as logger, pytest.raises(ValueError, match="'step'"):
        logger.log(1, {"step": 3})


def write_run(path, steps, report_to=()):
    with MetricsLogger(path, list(report_to), {}) as logger:
        for step in steps:
            logger.log(step, {"reward/mean": step / 10})
            logger.log_samples(step, [{"completion": f"c{step}-{i}"} for i in range(2)])


def test_resume_truncates_to_an_uninterrupted_run(tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    write_run(uninterrupted, range(1, 7))

    write_run(resumed, range(1, 6))  # checkpoint at 3, then killed after logging step 5
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # killed mid-write
    with MetricsLogger(resumed, [], {}, resume_step=3) as logger:
        for step in range(4, 7):
            logger.log(step, {"reward/mean": step / 10})
            logger.log_samples(step, [{"completion": f"c{step}-{i}"} for i in range(2)])

    for name in ("metrics.jsonl", "samples.jsonl"):
        assert (resumed / name).read_text() == (uninterrupted / name).read_text()
    assert not [p for p in resumed.iterdir() if p.name.startswith(".")]  # no temp files left


def test_fresh_start_replaces_old_files(tmp_path):
    write_run(tmp_path, [1, 2])
    write_run(tmp_path, [1])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_read_metrics_skips_torn_last_line_and_reports_corruption(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "kl": null}\n{"step": 2, "completion": "\xc3')  # cut inside a UTF-8 char
    assert read_metrics(path) == [{"step": 1, "kl": None}]

    path.write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        read_metrics(tmp_path / "nothing.jsonl")


def test_tensorboard_event_file_is_written(tmp_path):
    write_run(tmp_path, [1, 2], report_to=["tensorboard"])
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_disabled_logger_writes_nothing(tmp_path):
    out = tmp_path / "rank1"
    with MetricsLogger(out, ["tensorboard", "wandb"], {}, enabled=False) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log_samples(1, [{"completion": "x"}])
    assert not out.exists()


def test_unknown_tracker_is_named(tmp_path):
    with pytest.raises(ValueError, match="mlflow"):
        MetricsLogger(tmp_path, ["mlflow"], {})


def test_wandb_missing_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"wandb package is not installed.*pip install"):
        MetricsLogger(tmp_path, ["wandb"], {})


def test_wandb_gets_numbers_and_resumes_the_same_run(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        id = "run123"

        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["project"], kwargs["id"], kwargs["resume"], kwargs["config"]))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path, ["wandb"], {"lr": 1e-5}, wandb_project="p") as logger:
        logger.log(1, {"loss": 0.5, "kl": float("nan")})
    with MetricsLogger(tmp_path, ["wandb"], {"lr": 1e-5}, wandb_project="p", resume_step=1):
        pass
    assert calls == [
        ("init", "p", None, None, {"lr": 1e-5}),
        ("log", {"loss": 0.5}, 1),  # non-finite values are not sent
        ("finish",),
        ("init", "p", "run123", "allow", {"lr": 1e-5}),
        ("finish",),
    ]


def test_closed_logger_refuses_to_log(tmp_path):
    logger = MetricsLogger(tmp_path, [], {})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"loss": 1.0})
