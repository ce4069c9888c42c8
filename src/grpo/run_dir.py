"""The run folder's guard: never write into another run's folder by accident."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpo.config import ConfigError, RunConfig, dump_config

MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")


def prepare_output_dir(cfg: RunConfig, is_main: bool) -> Path:
    """Create ``train.output_dir``; refuse one that holds a run unless resuming or overwriting.

    On resume the folder (and its checkpoints and metrics) is kept; with ``overwrite`` the old
    run's files are removed first. The resolved config is written as ``config.yaml``.
    """
    out = Path(cfg.train.output_dir)
    if not is_main:  # rank 0 alone decides (it may already have written config.yaml); others follow it
        return out
    has_run = out.is_dir() and any((out / m).exists() for m in MARKERS)
    if has_run and not (cfg.train.resume or cfg.train.overwrite):
        raise ConfigError(f"train.output_dir: {out} already holds a run (config.yaml/metrics/checkpoints); "
                          "pass --resume to continue it, --overwrite to replace it, or choose another folder")
    if cfg.train.resume and not has_run:
        raise ConfigError(f"train.resume: {out} holds no run to resume")
    if has_run and cfg.train.overwrite and not cfg.train.resume:
        for marker in MARKERS + ("samples.jsonl", "plots", "tensorboard", "final", "eval", "weights"):
            target = out / marker
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / "config.yaml")
    return out
