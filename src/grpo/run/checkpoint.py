"""Save and restore training state: model (or LoRA adapter), optimizer, scheduler, RNGs, trainer state.

Layout of a run folder::

    output_dir/checkpoints/step-N/   model (HF format) or adapter, tokenizer, optimizer.pt,
                                     scheduler.pt, rng.pt, trainer_state.json; scaler.pt under
                                     model.fp16 (the loss scaler's state, Trainer's name)
    output_dir/final/                the trained model (or adapter) and tokenizer, HF format

The Python API names its checkpoints as TRL does (``CheckpointLayout``, ``train.checkpoint_layout: trl``):
``output_dir/checkpoint-<optimizer update>/``, grpo's loop state in ``grpo_state.json`` and transformers'
``trainer_state.json`` (log history, global step) beside it.

Every folder is written into a hidden temporary sibling, fsynced, then renamed into place, so a
crash or a full disk leaves the earlier checkpoints intact and never a half-written ``step-N``.
``trainer_state.json`` is written last; a folder without it is not a checkpoint.

Loading never unpickles arbitrary objects: ``.pt`` files are read with ``weights_only=True`` and
hold only tensors and plain containers (the Python RNG state is stored as lists for that reason).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError

from grpo.compat import save_pretrained
from grpo.models.state_dicts import unmatched_keys
from grpo.run import rng_state
from grpo.run.durable import fsync_dir, fsync_file, replace_dir, settle_leftover
from grpo.run.tracking import json_safe

CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
BEST_DIR = "best"  # the weights of the best evaluation (train.best_metric), written as final/ is
BEST_FILE = "best.json"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
SCALER_FILE = "scaler.pt"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"

GRPO_STATE_FILE = "grpo_state.json"  # the loop state under the TRL layout (trainer_state.json is transformers')
_TEMP_DIR = re.compile(r"^\.(?P<kind>tmp|old)-(?P<name>.+)-\d+$")  # ".tmp-step-N-<pid>", ".old-final-<pid>"


class CheckpointError(RuntimeError):
    """A checkpoint is missing a file, is torn or corrupt, or does not match the model."""


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a run's checkpoints live: ``<output_dir>/<parent>/<prefix><number>``, the number a grpo step times
    ``updates_per_step`` (TRL numbers checkpoints by optimizer update); ``state_file`` holds the loop state and,
    written last, marks the folder complete."""

    parent: str = CHECKPOINTS_DIR
    prefix: str = "step-"
    updates_per_step: int = 1
    state_file: str = TRAINER_STATE_FILE

    def root(self, output_dir: str | os.PathLike) -> Path:
        return Path(output_dir) / self.parent

    def folder(self, output_dir: str | os.PathLike, step: int) -> Path:
        return self.root(output_dir) / f"{self.prefix}{step * self.updates_per_step}"

    def step_of(self, name: str) -> int | None:
        """The grpo step of a folder name, None for another name (or a number that is no whole step)."""
        match = re.fullmatch(re.escape(self.prefix) + r"(\d+)", name)
        if match is None or int(match.group(1)) % self.updates_per_step:
            return None
        return int(match.group(1)) // self.updates_per_step


GRPO_LAYOUT = CheckpointLayout()


def checkpoint_layout(name: str, updates_per_step: int = 1) -> CheckpointLayout:
    """``train.checkpoint_layout``'s layout: grpo's ``checkpoints/step-N`` or TRL's ``checkpoint-<update>``."""
    layouts = {"grpo": GRPO_LAYOUT,
               "trl": CheckpointLayout("", "checkpoint-", updates_per_step, GRPO_STATE_FILE)}
    if name not in layouts:
        raise ValueError(f"unknown checkpoint layout {name!r}; known: {sorted(layouts)}")
    return layouts[name]


# ---------------------------------------------------------------- saving


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module | None,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    trainer_state: dict,
    save_total_limit: int | None,
    state_dict: dict[str, torch.Tensor] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    layout: CheckpointLayout = GRPO_LAYOUT,
    scaler: torch.amp.GradScaler | None = None,
) -> Path:
    """Write ``output_dir/checkpoints/step-{step}/`` (``layout``'s folder) atomically, then prune the oldest
    beyond the limit.

    Args:
        model: a ``PreTrainedModel`` or ``PeftModel`` (only the adapter is saved), possibly wrapped
            in ``DistributedDataParallel``; None writes no weights (FSDP2: each rank wrote its shards beside).
        tokenizer: saved with ``save_pretrained``; ``None`` skips it.
        optimizer, scheduler: their ``state_dict()`` go to ``optimizer.pt``/``scheduler.pt``; ``None`` skips.
        trainer_state: JSON-compatible loop state (data position, metrics, consumed batch ids, ...);
            saved with ``"step": step`` added. Non-finite floats become ``null``.
        save_total_limit: keep at most this many checkpoints (the new one always survives); ``None`` keeps all.
        state_dict: the weights to write instead of ``model.state_dict()`` (e.g. gathered from ZeRO-3 shards).
        write_extra: called with the (temporary) folder to add more state to it, e.g. PPO's critic.
        scaler: fp16's loss scaler, its ``state_dict()`` to ``scaler.pt``; ``None`` skips it.
    Returns the checkpoint folder.
    """
    if save_total_limit is not None and save_total_limit < 1:
        raise ValueError(f"save_total_limit must be >= 1 or None, got {save_total_limit}")
    if trainer_state.get("step", step) != step:
        raise ValueError(f"trainer_state['step']={trainer_state['step']} disagrees with step={step}")
    # Serialise first: an unserialisable state must fail before anything touches the disk.
    try:
        state_json = json.dumps(json_safe({**trainer_state, "step": step}), indent=2, allow_nan=False)
    except TypeError as err:
        raise TypeError(f"trainer_state is not JSON-serialisable: {err}") from err

    def write(folder: Path) -> None:
        if model is not None:
            _save_model(model, folder, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
        if scaler is not None:
            torch.save(scaler.state_dict(), folder / SCALER_FILE)
        torch.save(rng_state.capture_rng(), folder / RNG_FILE)
        if write_extra is not None:
            write_extra(folder)
        (folder / layout.state_file).write_text(state_json, encoding="utf-8")  # last: marks it complete

    path = _write_dir_atomically(layout.folder(output_dir, step), write)
    if save_total_limit is not None:
        _prune(output_dir, layout, keep=path, limit=save_total_limit)
    return path


def save_final(output_dir: str | os.PathLike, model: torch.nn.Module, tokenizer: Any,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``output_dir/final/`` (HF format; for a PeftModel the adapter and ``adapter_config.json``);
    ``state_dict`` replaces the model's own weights (e.g. gathered from ZeRO-3 shards)."""
    def write(folder: Path) -> None:
        _save_model(model, folder, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return _write_dir_atomically(Path(output_dir) / FINAL_DIR, write)


def save_best(output_dir: str | os.PathLike, model: torch.nn.Module, tokenizer: Any, step: int, metric: str,
              value: float, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``output_dir/best/`` as ``save_final`` writes ``final/``, with ``best.json``: the step whose weights
    they are, the metric and its value."""
    def write(folder: Path) -> None:
        _save_model(model, folder, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        (folder / BEST_FILE).write_text(json.dumps({"step": step, "metric": metric, "value": value}) + "\n",
                                        encoding="utf-8")

    return _write_dir_atomically(Path(output_dir) / BEST_DIR, write)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``DistributedDataParallel`` (whose state-dict keys carry a ``module.`` prefix)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_peft(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def _save_model(model: torch.nn.Module, folder: Path, state_dict: dict | None = None) -> None:
    model = _unwrap(model)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    if _is_peft(model):
        save_pretrained(model, folder, safe_serialization=True, **extra)  # the adapter only
        expected = folder / ADAPTER_FILE
    else:
        # transformers 5 always writes safetensors (its safe_serialization argument is gone), and
        # leaves out tied weights such as lm_head.weight when embeddings are tied.
        save_pretrained(model, folder, **extra)
        expected = folder / (MODEL_INDEX_FILE if (folder / MODEL_INDEX_FILE).exists() else MODEL_FILE)
    if not expected.is_file():
        raise CheckpointError(f"save_pretrained did not write {expected}; cannot make a loadable checkpoint")


def _write_dir_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a hidden sibling folder, fsync it, then rename it to ``final``.

    On any failure the temporary folder is removed and the error re-raised; ``final`` is untouched.
    """
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{final.name}-{os.getpid()}"
    _remove_stale_temps(parent)
    tmp.mkdir()
    try:
        write(tmp)
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync_file(file)
        fsync_dir(tmp)
        replace_dir(tmp, final)
    except BaseException:
        # Also on KeyboardInterrupt; ignore_errors so a failing cleanup cannot hide the real error.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return final


def _remove_stale_temps(parent: Path) -> None:
    """Clean up after a save that was killed (a run folder has one writer, rank 0, so none is running)."""
    for entry in parent.iterdir():
        if not ((match := _TEMP_DIR.match(entry.name)) and entry.is_dir()):
            continue
        settle_leftover(entry, match["kind"], parent / match["name"])


def _complete_checkpoints(output_dir: str | os.PathLike, layout: CheckpointLayout) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint folder of ``layout``, oldest first."""
    root = layout.root(output_dir)
    if not root.is_dir():
        return []
    return sorted((step, entry) for entry in root.iterdir()
                  if (step := layout.step_of(entry.name)) is not None and (entry / layout.state_file).is_file())


def _prune(output_dir: str | os.PathLike, layout: CheckpointLayout, keep: Path, limit: int) -> None:
    """Delete the oldest checkpoints so that at most ``limit`` remain, never ``keep``."""
    others = [path for _, path in _complete_checkpoints(output_dir, layout) if path != keep]
    for path in others[:max(len(others) + 1 - limit, 0)]:
        shutil.rmtree(path)


def complete_checkpoints(output_dir: str | os.PathLike, layout: CheckpointLayout = GRPO_LAYOUT) -> list[Path]:
    """Every complete ``checkpoints/step-N`` folder of a run, oldest first (a resume falls back along it)."""
    return [path for _, path in _complete_checkpoints(output_dir, layout)]


def latest_checkpoint(output_dir: str | os.PathLike, layout: CheckpointLayout = GRPO_LAYOUT) -> Path | None:
    """The complete ``checkpoints/step-N`` folder with the largest N, or ``None`` when there is none."""
    found = _complete_checkpoints(output_dir, layout)
    return found[-1][1] if found else None


# ---------------------------------------------------------------- loading


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    state_file: str = TRAINER_STATE_FILE,
    scaler: torch.amp.GradScaler | None = None,
) -> dict:
    """Restore a checkpoint folder in place and return its trainer state (a dict with ``"step"``).

    Loads the model weights (full model or LoRA adapter, matching what ``model`` is; None: none), then
    the optimizer, scheduler and loss-scaler state when given, then the RNG states. Raises ``CheckpointError``
    naming the file when one is missing, torn, corrupt or does not match the model.
    """
    path = Path(path)
    state_file = path / state_file
    if not state_file.is_file():
        raise CheckpointError(f"{state_file} is missing: {path} is not a complete checkpoint")
    try:
        trainer_state = json.loads(state_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{state_file} cannot be read ({err}); the checkpoint is torn or corrupt") from err

    if model is not None:
        load_weights(path, model)
    if optimizer is not None:
        _load_state_dict_into(optimizer, path / OPTIMIZER_FILE)
    if scheduler is not None:
        _load_state_dict_into(scheduler, path / SCHEDULER_FILE)
    if scaler is not None:
        if not (path / SCALER_FILE).is_file():
            raise CheckpointError(f"{path / SCALER_FILE} is missing: the checkpoint was saved without model.fp16's "
                                  "loss scaler (a run in another precision); resume in the precision it was saved in")
        _load_state_dict_into(scaler, path / SCALER_FILE)
    if restore_rng:
        try:
            rng_state.restore_rng(_torch_load(path / RNG_FILE))
        except ValueError as err:
            raise CheckpointError(f"{path / RNG_FILE} does not hold valid RNG states: {err}") from err
    return trainer_state


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        return safetensors.torch.load_file(file)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file} cannot be read ({err}); the checkpoint is torn or corrupt") from err


def _read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a full-model checkpoint: ``model.safetensors`` or the shards of its index."""
    index_file = path / MODEL_INDEX_FILE
    if not index_file.exists():
        if not (path / MODEL_FILE).exists() and (path / ADAPTER_FILE).exists():
            raise CheckpointError(f"{path} holds a LoRA adapter, but the model to load into is not a PeftModel")
        return _read_safetensors(path / MODEL_FILE)
    try:
        shards = sorted(set(json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
        raise CheckpointError(f"{index_file} cannot be read ({err}); the checkpoint is torn or corrupt") from err
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(_read_safetensors(path / shard))
    return state


def load_weights(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """The weights of a saved folder (a checkpoint, best/, final/: the adapter for a PeftModel, else the full
    model) into ``model`` in place; CheckpointError naming the file when they are missing or do not fit."""
    model = _unwrap(model)
    if _is_peft(model):
        _load_adapter(Path(path), model)
    else:
        _load_full_model(Path(path), model)


def _load_full_model(path: Path, model: torch.nn.Module) -> None:
    state = _read_model_weights(path)
    missing, unexpected = unmatched_keys(model.state_dict(), state)  # a tied weight is saved once
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model ({len(missing)} missing, e.g. "
                              f"{missing[:3]}; {len(unexpected)} unexpected, e.g. {unexpected[:3]})")
    try:
        model.load_state_dict(state, strict=False)  # strictness checked above, tied aliases allowed
    except RuntimeError as err:  # shape mismatches
        raise CheckpointError(f"{path}: weights do not fit the model: {err}") from err


def _load_adapter(path: Path, model: torch.nn.Module) -> None:
    file = path / ADAPTER_FILE
    if not file.exists() and (path / MODEL_FILE).exists():
        raise CheckpointError(f"{path} holds full model weights, but the model to load into is a PeftModel")
    state = _read_safetensors(file)
    expected = set(get_peft_model_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{file}: adapter does not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}); was it saved with another LoRA config?")
    try:
        set_peft_model_state_dict(model, state)
    except RuntimeError as err:  # shape mismatches, e.g. another rank r
        raise CheckpointError(f"{file}: adapter does not fit the model: {err}") from err


def _torch_load(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as err:
        raise CheckpointError(f"{file} cannot be read ({err}); the checkpoint is torn or corrupt") from err


def _load_state_dict_into(obj: Any, file: Path) -> None:
    state = _torch_load(file)
    try:
        obj.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"{file} does not fit {type(obj).__name__}: {err}") from err
