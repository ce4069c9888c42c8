"""Helpers that look through a model's wrappers: the module under DDP, and the ids that end a completion."""

from __future__ import annotations

import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DDP wrapper (generation must not go through DDP's forward hooks)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's generation_config EOS ids
    (Qwen2.5-Instruct stops at both <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(unwrap_model(model).generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)
