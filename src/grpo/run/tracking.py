"""Metrics and samples of a run: JSON lines on disk (the source of truth), plus TensorBoard and W&B.

``metrics.jsonl`` holds one ``{"step": N, **metrics}`` object per ``MetricsLogger.log`` call and
``samples.jsonl`` one ``{"step": N, **sample}`` object per logged completion. Every line is flushed
and fsynced as it is written, so a killed run loses at most the line in flight; a resumed run first
drops the lines after its checkpoint's step, so its files equal those of an uninterrupted run.
Non-finite floats are written as ``null`` so every line stays valid JSON.

Only the main process logs: other ranks pass ``enabled=False`` and get a logger that does nothing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from grpo.config.kinds import TRACKERS

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id.txt"
KNOWN_TRACKERS = TRACKERS  # the names log.report_to may give (declared with the config)


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf floats replaced by ``None`` and tensor/numpy scalars made plain Python.

    Recurses into dicts, lists and tuples (tuples become lists, dict keys become strings), so the
    result can be written with ``json.dumps(..., allow_nan=False)``.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        # torch tensors and numpy scalars/arrays: tolist() gives Python numbers (a scalar for 0-d).
        return json_safe(value.tolist())
    return value


def _dump_line(record: dict) -> str:
    return json.dumps(json_safe(record), ensure_ascii=False, allow_nan=False) + "\n"


def _split_records(path: Path) -> list[tuple[str, dict]]:
    """Parse a JSON-lines file into ``(raw line, object)`` pairs.

    A last line that does not parse is a write cut short by a kill and is dropped; an unparsable
    line anywhere else is corruption and raises ``ValueError`` naming the file and line.
    """
    # Split bytes, not text: a write cut short may end inside a multi-byte UTF-8 character.
    lines = path.read_bytes().split(b"\n")
    records = []
    for index, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
            if index == len(lines) - 1:
                break  # the torn final line of a killed write
            raise ValueError(f"{path}:{index + 1}: not a valid JSON object line ({err})") from err
        records.append((line, obj))
    return records


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` (or ``samples.jsonl``) file, skipping a torn last line.

    Raises ``FileNotFoundError`` naming the path when it does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (is this a run folder, and has it logged a step?)")
    return [obj for _, obj in _split_records(path)]


def _truncate_after(path: Path, last_step: int | None) -> None:
    """Atomically rewrite ``path`` keeping only lines with ``step <= last_step`` (none when None).

    A resumed run continues after ``last_step``; the lines it will write again are dropped here.
    """
    if not path.exists():
        return
    if last_step is None:
        kept = []
    else:
        kept = [line for line, obj in _split_records(path) if not isinstance(obj.get("step"), int)
                or obj["step"] <= last_step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temp file behind, then report the real error
        raise


def _numeric_scalars(metrics: dict) -> dict[str, float]:
    """The finite numeric entries of a JSON-safe metrics dict (what TensorBoard/W&B can plot)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class MetricsLogger:
    """Write a run's metrics and samples to JSON lines and the requested trackers.

    Args:
        output_dir: the run folder; ``metrics.jsonl``, ``samples.jsonl`` and ``tensorboard/`` go here.
        report_to: trackers besides the JSON lines: any of ``"tensorboard"``, ``"wandb"``.
        config: the resolved run config (a plain dict), recorded with W&B.
        enabled: ``False`` on non-main ranks: every method is then a no-op and nothing is touched.
        resume_step: the step of the checkpoint a resumed run continues from; later lines are
            removed from the files (TensorBoard events too). ``None`` starts the files afresh.
        wandb_project: the W&B project name.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        report_to: list[str],
        config: dict,
        enabled: bool = True,
        resume_step: int | None = None,
        wandb_project: str = "grpo",
    ) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self._metrics_file = None
        self._samples_file = None
        self._tensorboard = None
        self._wandb_run = None
        self._closed = False
        if not enabled:
            return
        unknown = [t for t in report_to if t not in KNOWN_TRACKERS]
        if unknown:
            raise ValueError(f"report_to: unknown tracker(s) {unknown}; known: {', '.join(KNOWN_TRACKERS)}")

        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, SAMPLES_FILE):
            _truncate_after(self.output_dir / name, resume_step)
        # Line buffering writes each record as it is completed; log() also fsyncs it.
        self._metrics_file = open(self.output_dir / METRICS_FILE, "a", buffering=1, encoding="utf-8")
        self._samples_file = open(self.output_dir / SAMPLES_FILE, "a", buffering=1, encoding="utf-8")

        if "tensorboard" in report_to:
            self._tensorboard = _start_tensorboard(self.output_dir / TENSORBOARD_DIR, resume_step)
        if "wandb" in report_to:
            self._wandb_run = _start_wandb(self.output_dir, config, wandb_project, resume_step is not None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl`` and send the numbers to the trackers."""
        if not self.enabled:
            return
        self._check_open()
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key: the step is the first argument of log()")
        record = json_safe({"step": int(step), **metrics})
        _append_durably(self._metrics_file, _dump_line(record))
        scalars = _numeric_scalars({k: v for k, v in record.items() if k != "step"})
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, global_step=int(step))
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=int(step))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append one ``{"step": step, **sample}`` line per sample to ``samples.jsonl``."""
        if not self.enabled or not samples:
            return
        self._check_open()
        lines = []
        for sample in samples:
            if "step" in sample:
                raise ValueError("a sample must not contain a 'step' key: the step is the first argument")
            lines.append(_dump_line({"step": int(step), **sample}))
        _append_durably(self._samples_file, "".join(lines))

    def close(self) -> None:
        """Flush and close the files and trackers; safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        for f in (self._metrics_file, self._samples_file):
            if f is not None:
                f.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.output_dir} is closed")

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _append_durably(f, text: str) -> None:
    """Write ``text`` and push it to disk, so a kill right after loses nothing already logged."""
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def _start_tensorboard(log_dir: Path, resume_step: int | None):
    # purge_step hides events at or after it that an interrupted run wrote past its last checkpoint.
    # On first use: a run that does not log to TensorBoard skips its import (tensorboard's protobufs).
    from torch.utils.tensorboard import SummaryWriter

    purge_step = resume_step + 1 if resume_step is not None else None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)


def _start_wandb(output_dir: Path, config: dict, project: str, resume: bool):
    """Start (or, on resume, continue) the run's W&B run; its id is kept in the run folder."""
    try:
        import wandb  # optional extra (grpo[wandb])
    except ImportError as err:
        raise ImportError(
            "log.report_to includes 'wandb' but the wandb package is not installed; "
            "install it with `pip install 'grpo[wandb]'` or remove 'wandb' from log.report_to"
        ) from err
    id_file = output_dir / WANDB_ID_FILE
    run_id = id_file.read_text(encoding="utf-8").strip() if resume and id_file.exists() else None
    run = wandb.init(project=project, config=json_safe(config), dir=str(output_dir),
                     id=run_id, resume="allow" if run_id else None)
    id_file.write_text(str(run.id), encoding="utf-8")
    return run
