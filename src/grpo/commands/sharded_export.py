"""``grpo export`` of an FSDP2 checkpoint (``checkpoints/step-N`` whose loop state names its ``fsdp-step-N`` shards):
the run's model is built as the run built it (``model.*`` of its ``config.yaml``: the base, LoRA's adapter), the
shards are read into it in this one process (``grpo.run.sharded_checkpoint.load_weights``, no process group, any
rank count they were written at), and a LoRA adapter is merged. ``grpo.commands.export`` writes the result."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from grpo.config import ConfigError, RunConfig, load_config
from grpo.models.loading import DTYPES, load_policy, load_tokenizer
from grpo.run.checkpoint import GRPO_STATE_FILE, TRAINER_STATE_FILE
from grpo.run.sharded_checkpoint import ShardedCheckpointError, load_weights

RUN_CONFIG = "config.yaml"


def shards_of(checkpoint: Path) -> Path | None:
    """The shards' folder an FSDP2 checkpoint folder names in its loop state (grpo's or the TRL layout's); None for
    any other folder."""
    for state_file in (GRPO_STATE_FILE, TRAINER_STATE_FILE):
        try:
            name = json.loads((checkpoint / state_file).read_text(encoding="utf-8")).get("fsdp_dir")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(name, str):
            return checkpoint.parent / name
    return None


def _run_config(checkpoint: Path) -> RunConfig:
    """The config of the run the checkpoint belongs to (``checkpoints/step-N``: two folders up; TRL's
    ``checkpoint-N``: one)."""
    for folder in (checkpoint.parent.parent, checkpoint.parent):
        if (folder / RUN_CONFIG).is_file():
            return load_config(folder / RUN_CONFIG)
    raise ConfigError(f"export: {checkpoint} is an FSDP2 checkpoint, whose shards hold no model config; its run "
                      f"folder's {RUN_CONFIG} (which names the model) was not found above it")


def load_sharded_model(checkpoint: Path, shards: Path, dtype: str | None):
    """``(model, tokenizer)``: the run's model with the checkpoint's weights (LoRA merged), in ``dtype`` (None: the
    run's training dtype), eval mode."""
    cfg = _run_config(checkpoint)
    model_cfg = replace(cfg.model, gradient_checkpointing=False)
    model = load_policy(model_cfg, torch.device("cpu"), master_weights=cfg.model.lora_r == 0)
    try:
        load_weights(shards, model)
    except ShardedCheckpointError as err:
        raise ConfigError(f"export: {err}") from err
    if cfg.model.lora_r > 0:
        model = model.merge_and_unload()
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"export: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    model.to(DTYPES[dtype] if dtype else torch.bfloat16 if cfg.model.bf16 else torch.float32)
    model.eval()
    tokenizer = load_tokenizer(str(checkpoint), trust_remote_code=cfg.model.trust_remote_code)
    return model, tokenizer
