"""A run's checkpoints on every rank's behalf: save (DeepSpeed engine states, the HF-format checkpoint,
PPO's critic), load, and resume from the newest checkpoint that loads."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.critic import CRITIC_DIR, load_critic, save_critic
from grpo.parallel.distributed import DistInfo, barrier
from grpo.parallel.learners import zero3_full_state_dict
from grpo.run.checkpoint import (
    GRPO_LAYOUT,
    CheckpointError,
    CheckpointLayout,
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

if TYPE_CHECKING:
    from grpo.parallel.trainable import Trainable


def _deepspeed_dir(out: Path, step: int, layout: CheckpointLayout) -> Path:
    return layout.root(out) / f"deepspeed-step-{step}"


def save_run_checkpoint(out: Path, step: int, trainable: Trainable, tokenizer, state: dict,
                        save_total_limit: int | None, info: DistInfo, critic=None,
                        layout: CheckpointLayout = GRPO_LAYOUT) -> Path:
    """A checkpoint of ``step`` on every rank's behalf. Under DeepSpeed every rank first writes its
    engine state (partitioned optimizer) to ``deepspeed-step-N/``; rank 0 then writes the HF-format
    checkpoint, whose appearance (atomic rename) marks the whole checkpoint complete. PPO's ``critic``
    (a ``grpo.critic.Critic``) goes into its ``critic/`` folder; ``layout`` names the folder. Returns it."""
    write_critic = (lambda folder: save_critic(folder / CRITIC_DIR, critic)) if critic is not None else None

    if trainable.deepspeed:
        trainable.learner.engine.save_checkpoint(str(_deepspeed_dir(out, step, layout)))
        state = {**state, "deepspeed_dir": _deepspeed_dir(out, step, layout).name}
    gathered = zero3_full_state_dict(trainable.learner)  # a collective under ZeRO-3
    if info.is_main:
        save_checkpoint(out, step, trainable.policy, tokenizer, trainable.optimizer, trainable.scheduler, state,
                        save_total_limit, state_dict=gathered, write_extra=write_critic, layout=layout,
                        scaler=trainable.scaler)
        if trainable.deepspeed:
            _prune_deepspeed_dirs(out, save_total_limit, layout)
    barrier(info)
    return layout.folder(out, step)


def _prune_deepspeed_dirs(out: Path, keep: int | None, layout: CheckpointLayout) -> None:
    # Engine states whose HF checkpoint was pruned are unreachable: drop them too.
    live = {str(layout.step_of(p.name)) for p in layout.root(out).glob(f"{layout.prefix}*")}
    for engine_dir in layout.root(out).glob("deepspeed-step-*"):
        if keep is not None and engine_dir.name.removeprefix("deepspeed-step-") not in live:
            shutil.rmtree(engine_dir, ignore_errors=True)


def load_run_checkpoint(checkpoint: Path, trainable: Trainable, critic=None,
                        layout: CheckpointLayout = GRPO_LAYOUT) -> dict:
    """Restore weights, optimizer, schedule, fp16's loss scaler and RNG from ``checkpoint`` (and PPO's ``critic``
    from its ``critic/`` folder); returns its trainer state. Under DeepSpeed the engine restores weights and its
    partitioned optimizer itself."""
    if critic is not None:  # first: a checkpoint without a critic must fail before the policy is overwritten
        load_critic(checkpoint / CRITIC_DIR, critic)
    if trainable.deepspeed:
        state = json.loads((checkpoint / layout.state_file).read_text())
        trainable.learner.engine.load_checkpoint(str(checkpoint.parent / state["deepspeed_dir"]))
        return state
    return load_checkpoint(checkpoint, trainable.policy, trainable.optimizer, trainable.scheduler,
                           state_file=layout.state_file, scaler=trainable.scaler)


def resume_checkpoint(out: Path, trainable: Trainable, info: DistInfo, critic=None,
                      layout: CheckpointLayout = GRPO_LAYOUT, only: Path | None = None) -> tuple[Path, dict] | None:
    """Restore the newest checkpoint of ``out`` that loads (``only``: that checkpoint folder, no other, of ``out``
    or of another run's folder); returns it and its trainer state, or None when the folder holds no checkpoint.

    A checkpoint is written to a temporary folder and renamed, so a crash cannot tear one; a torn or
    corrupt file therefore means the disk or someone damaged it. The newest checkpoint that loads is
    used instead, with a warning naming the bad file: a run restarted unattended (a job scheduler, the
    decoupled launcher) then goes on losing only the steps after it, which it trains again exactly as
    before (prompts and sampling seeds are functions of the step), and the bad folder is replaced when
    the run saves that step again. When no checkpoint loads (e.g. the model no longer fits them) the
    newest one's error is raised: starting from scratch would silently discard the run.
    """
    candidates = complete_checkpoints(out, layout)[::-1]  # newest first
    if only is not None:
        only = Path(only)
        elsewhere = only.resolve().parent != layout.root(out).resolve()
        if elsewhere and layout.step_of(only.name) is not None and (only / layout.state_file).is_file():
            return only, load_run_checkpoint(only, trainable, critic, layout)
        if only.resolve() not in [c.resolve() for c in candidates]:
            raise CheckpointError(f"{only} is not a complete checkpoint ({layout.prefix}<N> with "
                                  f"{layout.state_file}); those of {out}: "
                                  f"{', '.join(c.name for c in candidates[::-1]) or 'none'}")
        return only, load_run_checkpoint(only, trainable, critic, layout)
    first_error = None
    for checkpoint in candidates:
        try:
            return checkpoint, load_run_checkpoint(checkpoint, trainable, critic, layout)
        except CheckpointError as err:
            first_error = first_error or err
            if info.is_main:  # every rank reads the same files and reaches the same checkpoint
                print(f"grpo: warning: cannot resume from {checkpoint}: {err}; trying the checkpoint before it",
                      file=sys.stderr, flush=True)
    if first_error is not None:
        raise CheckpointError(f"no checkpoint in {layout.root(out)} can be loaded; the newest: {first_error}")
    return None
