"""The run folder's guard: never write into another run's folder by accident, and write nothing
into it before the run is known to start (a typo must not damage a run being resumed)."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpo.config import ConfigError, RunConfig, run_config_text
from grpo.config.rules import updates_per_step
from grpo.run.checkpoint import GRPO_LAYOUT, CheckpointLayout, checkpoint_layout

MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
RUN_FILES = MARKERS + ("samples.jsonl", "plots", "tensorboard", "final", "best", "eval", "weights")


def continues_own_run(cfg: RunConfig) -> bool:
    """Whether the run continues the one in its ``output_dir`` (``train.resume``, or ``train.resume_from`` naming
    a checkpoint folder there); a ``resume_from`` elsewhere (another run's checkpoint) is a new run in
    ``output_dir`` that starts from that checkpoint's weights, optimizer and step, guarded as any new run."""
    if cfg.train.resume:
        return True
    if cfg.train.resume_from is None:
        return False
    layout = checkpoint_layout(cfg.train.checkpoint_layout, updates_per_step(cfg))
    return Path(cfg.train.resume_from).resolve().parent == layout.root(cfg.train.output_dir).resolve()


def check_output_dir(cfg: RunConfig) -> Path:
    """Refuse a ``train.output_dir`` that holds a run unless resuming or overwriting. Writes nothing."""
    out = Path(cfg.train.output_dir)
    has_run = out.is_dir() and any((out / m).exists() for m in MARKERS)
    resuming = continues_own_run(cfg)
    if has_run and not (resuming or cfg.train.overwrite):
        raise ConfigError(f"train.output_dir: {out} already holds a run (config.yaml/metrics/checkpoints); "
                          "pass --resume to continue it, --overwrite to replace it, or choose another folder")
    if resuming and not has_run:
        raise ConfigError(f"train.resume: {out} holds no run to resume")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir: {out} exists and is not a folder")
    return out


def claim_output_dir(cfg: RunConfig, is_main: bool, layout: CheckpointLayout = GRPO_LAYOUT) -> Path:
    """Make the folder the run's, once setup succeeded: with ``overwrite`` (and no resume) the old run's
    files go first (``layout``'s checkpoint folders too); the resolved config is written as ``config.yaml``.
    Rank 0 only writes."""
    out = Path(cfg.train.output_dir)
    if not is_main:
        return out
    if cfg.train.overwrite and not continues_own_run(cfg):
        in_root = not layout.parent and out.is_dir()  # TRL's checkpoint-N sit beside the run's files
        stale = [p.name for p in out.iterdir() if layout.step_of(p.name) is not None] if in_root else []
        for name in [*RUN_FILES, *stale]:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)
    run_config_text(cfg, out / "config.yaml")
    return out
