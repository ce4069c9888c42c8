"""``train(resume_from_checkpoint=...)`` by TRL's rules, over grpo's checkpoints in TRL's layout
(``<output_dir>/checkpoint-<optimizer update>/``, ``grpo.run.checkpoint.CheckpointLayout``): True is the
newest, a path is that checkpoint, anything else a ValueError naming it."""

from __future__ import annotations

from pathlib import Path

from grpo.config import RunConfig
from grpo.run.checkpoint import complete_checkpoints
from grpo.training.prepare import run_layout

TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TrainerState, beside grpo's own state


def resumed_checkpoint(resume: bool | str | Path | None, cfg: RunConfig) -> Path | None:
    """The checkpoint folder ``train(resume_from_checkpoint=resume)`` continues from; None: a new run."""
    if resume is None or resume is False:
        return None
    out = Path(cfg.train.output_dir)
    found = complete_checkpoints(out, run_layout(cfg))
    if resume is True:
        if not found:
            raise ValueError(f"No valid checkpoint found in output directory ({out}): "
                             "resume_from_checkpoint=True continues the newest checkpoint-<step> there")
        return found[-1]
    if not isinstance(resume, (str, Path)):
        raise TypeError(f"resume_from_checkpoint must be True, a checkpoint folder or None, got {type(resume).__name__}")
    folder = Path(resume)
    if not folder.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {resume}")
    if folder.resolve() not in [f.resolve() for f in found]:
        names = ", ".join(f.name for f in found) or "none yet"
        raise ValueError(f"resume_from_checkpoint={str(resume)!r} is not a complete checkpoint of args.output_dir "
                         f"({out}; its checkpoints: {names}): grpo continues a run in its own folder")
    return folder
