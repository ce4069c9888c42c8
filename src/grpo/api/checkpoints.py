"""``train(resume_from_checkpoint=...)`` by TRL's rules, over grpo's checkpoints in TRL's layout
(``<output_dir>/checkpoint-<optimizer update>/``, ``grpo.run.checkpoint.CheckpointLayout``): True is the
newest, a path is that checkpoint (of ``output_dir`` or of another run grpo wrote), anything else a ValueError
naming it."""

from __future__ import annotations

from pathlib import Path

from grpo.config import RunConfig
from grpo.config.rules import updates_per_step
from grpo.run.checkpoint import complete_checkpoints
from grpo.training.prepare import run_layout

TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TrainerState, beside grpo's own state


def resumed_checkpoint(resume: bool | str | Path | None, cfg: RunConfig) -> Path | None:
    """The checkpoint folder ``train(resume_from_checkpoint=resume)`` continues from; None: a new run."""
    if resume is None or resume is False:
        return None
    out, layout = Path(cfg.train.output_dir), run_layout(cfg)
    found = complete_checkpoints(out, layout)
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
    if folder.resolve() in [f.resolve() for f in found]:
        return folder
    if folder.resolve().parent == layout.root(out).resolve():
        names = ", ".join(f.name for f in found) or "none yet"
        raise ValueError(f"resume_from_checkpoint={str(resume)!r} is not a complete checkpoint of args.output_dir "
                         f"({out}; its checkpoints: {names})")
    # Another run's checkpoint: this run starts from its weights, optimizer, schedule, RNG and step, as TRL's.
    if layout.step_of(folder.name) is None:
        raise ValueError(f"resume_from_checkpoint={str(resume)!r}: not a checkpoint folder of this run's shape "
                         f"({layout.prefix}<global step>, the step a multiple of the updates per step "
                         f"{updates_per_step(cfg)})")
    if not (folder / layout.state_file).is_file():
        raise ValueError(f"resume_from_checkpoint={str(resume)!r} has no {layout.state_file}: grpo resumes the "
                         "checkpoints it wrote (that file holds the step and the data order; a checkpoint written "
                         "by TRL's own trainer has none)")
    return folder
