"""A run's checkpoints on every rank's behalf: save (DeepSpeed engine states or FSDP2's shards, the HF-format
checkpoint, PPO's critic), load, and resume from the newest checkpoint that loads."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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
from grpo.run.sharded_checkpoint import (
    SHARDED_PREFIX,
    ShardedCheckpointError,
    clear_leftover,
    load_sharded,
    save_sharded,
)
from grpo.step.ref_sync import load_saved_reference, save_reference

if TYPE_CHECKING:
    from grpo.parallel.trainable import Trainable


DEEPSPEED_PREFIX = "deepspeed-step-"


def _deepspeed_dir(out: Path, step: int, layout: CheckpointLayout) -> Path:
    return layout.root(out) / f"{DEEPSPEED_PREFIX}{step}"


def _sharded_dir(out: Path, step: int, layout: CheckpointLayout) -> Path:
    return layout.root(out) / f"{SHARDED_PREFIX}{step}"


def _save_shards(out: Path, step: int, trainable: Trainable, info: DistInfo, layout: CheckpointLayout) -> str:
    """FSDP2: every rank writes its shards to ``fsdp-step-N/`` (a folder a killed save left is removed first);
    returns the folder's name."""
    folder = _sharded_dir(out, step, layout)
    if info.is_main:
        clear_leftover(folder)
    barrier(info)
    save_sharded(folder, trainable.policy, trainable.optimizer)
    return folder.name


def save_run_checkpoint(out: Path, step: int, trainable: Trainable, tokenizer, state: dict,
                        save_total_limit: int | None, info: DistInfo, critic=None,
                        layout: CheckpointLayout = GRPO_LAYOUT, reference: torch.nn.Module | None = None) -> Path:
    """A checkpoint of ``step`` on every rank's behalf. Under DeepSpeed every rank first writes its
    engine state (partitioned optimizer) to ``deepspeed-step-N/``, under FSDP2 its shards of the weights and
    optimizer to ``fsdp-step-N/`` (``grpo.run.sharded_checkpoint``); rank 0 then writes the checkpoint folder
    (HF-format weights, except under FSDP2), whose appearance (atomic rename) marks the whole checkpoint complete.
    PPO's ``critic`` (a ``grpo.critic.Critic``) goes into its ``critic/`` folder, a moving ``reference``
    (``loss.ref_sync_steps``) into ``reference/``; ``layout`` names the folder. Returns it."""
    def write_extra(folder: Path) -> None:
        if critic is not None:
            save_critic(folder / CRITIC_DIR, critic)
        if reference is not None:
            save_reference(folder, reference)

    if trainable.deepspeed:
        trainable.learner.engine.save_checkpoint(str(_deepspeed_dir(out, step, layout)))
        state = {**state, "deepspeed_dir": _deepspeed_dir(out, step, layout).name}
    if trainable.fsdp:
        state = {**state, "fsdp_dir": _save_shards(out, step, trainable, info, layout)}
    gathered = zero3_full_state_dict(trainable.learner)  # a collective under ZeRO-3
    if info.is_main:
        model, optimizer = (None, None) if trainable.fsdp else (trainable.policy, trainable.optimizer)
        save_checkpoint(out, step, model, tokenizer, optimizer, trainable.scheduler, state,
                        save_total_limit, state_dict=gathered, write_extra=write_extra, layout=layout,
                        scaler=trainable.scaler)
        if trainable.deepspeed or trainable.fsdp:
            prefix = DEEPSPEED_PREFIX if trainable.deepspeed else SHARDED_PREFIX
            _prune_state_dirs(out, save_total_limit, layout, prefix)
    barrier(info)
    return layout.folder(out, step)


def _prune_state_dirs(out: Path, keep: int | None, layout: CheckpointLayout, prefix: str) -> None:
    # Engine states and shards whose checkpoint folder was pruned are unreachable: drop them too.
    live = {str(layout.step_of(p.name)) for p in layout.root(out).glob(f"{layout.prefix}*")}
    for state_dir in layout.root(out).glob(f"{prefix}*"):
        if keep is not None and state_dir.name.removeprefix(prefix) not in live:
            shutil.rmtree(state_dir, ignore_errors=True)


def load_run_checkpoint(checkpoint: Path, trainable: Trainable, critic=None,
                        layout: CheckpointLayout = GRPO_LAYOUT, reference: torch.nn.Module | None = None) -> dict:
    """Restore weights, optimizer, schedule, fp16's loss scaler and RNG from ``checkpoint`` (and PPO's ``critic``
    from its ``critic/`` folder, a moving ``reference`` from ``reference/`` where it has one); returns its trainer
    state. Under DeepSpeed the engine restores weights and its partitioned optimizer itself; under FSDP2 every rank
    reads its shards (at any rank count)."""
    if critic is not None:  # first: a checkpoint without a critic must fail before the policy is overwritten
        load_critic(checkpoint / CRITIC_DIR, critic)
    if reference is not None:  # none saved: the reference never moved, and is the initial weights it holds
        load_saved_reference(checkpoint, reference)
    if trainable.fsdp:
        state = load_checkpoint(checkpoint, None, None, trainable.scheduler, state_file=layout.state_file)
        if not isinstance(state.get("fsdp_dir"), str):
            raise CheckpointError(f"{checkpoint} was written without train.fsdp and this run is with it; resume it "
                                  "as it was written")
        try:
            load_sharded(checkpoint.parent / state["fsdp_dir"], trainable.policy, trainable.optimizer)
        except ShardedCheckpointError as err:
            raise CheckpointError(str(err)) from err
        return state
    if _names_shards(checkpoint, layout):
        raise CheckpointError(f"{checkpoint} was written with train.fsdp (its weights are each rank's shards) and "
                              "this run is without it; resume it with train.fsdp: true (any rank count), or write "
                              "its weights as a plain model with grpo export")
    if trainable.deepspeed:
        state = json.loads((checkpoint / layout.state_file).read_text())
        trainable.learner.engine.load_checkpoint(str(checkpoint.parent / state["deepspeed_dir"]))
        return state
    return load_checkpoint(checkpoint, trainable.policy, trainable.optimizer, trainable.scheduler,
                           state_file=layout.state_file, scaler=trainable.scaler)


def _names_shards(checkpoint: Path, layout: CheckpointLayout) -> bool:
    """Whether a checkpoint's loop state names FSDP2 shards (False when it cannot be read: loading says why)."""
    try:
        return "fsdp_dir" in json.loads((checkpoint / layout.state_file).read_text())
    except (OSError, ValueError):
        return False


def resume_checkpoint(out: Path, trainable: Trainable, info: DistInfo, critic=None,
                      layout: CheckpointLayout = GRPO_LAYOUT, only: Path | None = None,
                      reference: torch.nn.Module | None = None) -> tuple[Path, dict] | None:
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
            return only, load_run_checkpoint(only, trainable, critic, layout, reference)
        if only.resolve() not in [c.resolve() for c in candidates]:
            raise CheckpointError(f"{only} is not a complete checkpoint ({layout.prefix}<N> with "
                                  f"{layout.state_file}); those of {out}: "
                                  f"{', '.join(c.name for c in candidates[::-1]) or 'none'}")
        return only, load_run_checkpoint(only, trainable, critic, layout, reference)
    first_error = None
    for checkpoint in candidates:
        try:
            return checkpoint, load_run_checkpoint(checkpoint, trainable, critic, layout, reference)
        except CheckpointError as err:
            first_error = first_error or err
            if info.is_main:  # every rank reads the same files and reaches the same checkpoint
                print(f"grpo: warning: cannot resume from {checkpoint}: {err}; trying the checkpoint before it",
                      file=sys.stderr, flush=True)
    if first_error is not None:
        raise CheckpointError(f"no checkpoint in {layout.root(out)} can be loaded; the newest: {first_error}")
    return None
