"""FSDP2 checkpoints: each rank writes its own shards of the model and optimizer state with
``torch.distributed.checkpoint`` (DCP), into ``checkpoints/fsdp-step-N/`` beside the ``step-N/`` folder that
holds the rest of the checkpoint (schedule, RNG, tokenizer, loop state naming the DCP folder) and marks it
complete (``grpo.training.resume``).

DCP records every tensor by name with its global shape and where each rank's piece sits in it, so a checkpoint
loads at any rank count (2 ranks -> 3 -> 1): each rank reads the pieces that overlap its own shards. Model
keys are the module's own names (``model.layers.0.mlp.up_proj.weight``, peft's for LoRA), optimizer state is
keyed by those names too (``torch.distributed.checkpoint.state_dict``), never by parameter position. A frozen
base (LoRA) is not written: it is the model the run loads from ``model.name_or_path``.

``load_weights`` reads the model part alone into a plain model in one process, with no process group, for
``grpo export``.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

SHARDED_PREFIX = "fsdp-step-"  # checkpoints/fsdp-step-N: the DCP folder of checkpoints/step-N
METADATA_FILE = ".metadata"  # DCP's index, written last by the coordinator (rank 0)


class ShardedCheckpointError(RuntimeError):
    """A DCP folder is missing, torn, or does not fit the model or optimizer."""


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # on first use: only FSDP2 runs need DCP

    return StateDictOptions(ignore_frozen_params=True)


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of ``model`` and ``optimizer`` to ``folder`` (a collective: every rank calls it);
    DCP's coordinator writes ``.metadata`` after all ranks wrote (each file fsynced), so a folder with it is whole.
    A folder left by a save that was killed must be gone first (``clear_leftover``)."""
    import torch.distributed.checkpoint as dcp  # on first use: only FSDP2 runs need DCP
    from torch.distributed.checkpoint.state_dict import get_state_dict  # on first use, as above

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def clear_leftover(folder: Path) -> None:
    """Remove ``folder`` (rank 0, before the ranks save into it): a save killed midway leaves a partial one."""
    shutil.rmtree(folder, ignore_errors=True)


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore ``model`` and ``optimizer`` in place from ``folder``, resharded to this run's ranks (a collective).
    ShardedCheckpointError naming the folder when it is missing, torn or does not fit."""
    import torch.distributed.checkpoint as dcp  # on first use: only FSDP2 runs need DCP
    from torch.distributed.checkpoint.api import CheckpointException  # on first use, as above
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # on first use, as above

    _check_whole(folder)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options())
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_options())
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as err:
        raise ShardedCheckpointError(f"{folder}: the sharded checkpoint does not load into this run's model and "
                                     f"optimizer ({type(err).__name__}: {str(err)[:500]})") from err


def load_weights(folder: Path, model: torch.nn.Module) -> None:
    """The model part of ``folder`` into a plain ``model`` (its trainable tensors: all of a full model, a LoRA
    model's adapter), in this process alone (no process group; every piece of every tensor is read)."""
    import torch.distributed.checkpoint as dcp  # on first use: only FSDP2 checkpoints need DCP
    from torch.distributed.checkpoint.api import CheckpointException  # on first use, as above

    _check_whole(folder)
    trains_part = any(not p.requires_grad for p in model.parameters())
    wanted = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
              if not trains_part or (isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad)}
    state = {"model": {name: tensor.detach().clone() for name, tensor in wanted.items()}}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is what no_dist asks
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as err:
        raise ShardedCheckpointError(f"{folder}: its model weights do not load into {type(model).__name__} "
                                     f"({type(err).__name__}: {str(err)[:500]})") from err
    with torch.no_grad():
        for name, tensor in wanted.items():
            tensor.copy_(state["model"][name])


def _check_whole(folder: Path) -> None:
    if not (Path(folder) / METADATA_FILE).is_file():
        raise ShardedCheckpointError(f"{folder} is not a whole sharded checkpoint (no {METADATA_FILE}: missing, or "
                                     "its save was killed before the end)")
