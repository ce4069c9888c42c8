"""Helpers that look through a model's wrappers: the module under DDP, and the ids that end a completion."""

from __future__ import annotations

import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DDP wrapper (generation must not go through DDP's forward hooks)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP and/or a DeepSpeed engine (both keep it as ``.module``); a peft model stays
    itself (it forwards ``get_decoder``/``get_output_embeddings`` to the model it wraps)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(type(model), "zero_optimization_stage"):
        model = model.module
    return model


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head module (LoRA-wrapped when LoRA targets it; the input embedding's weight when tied),
    called as the model's forward calls it: ``[..., H] -> [..., V]``."""
    head = inner_model(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner_model(model)).__name__} has no output embeddings (LM head) to apply")
    return head


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body under the LM head (transformers' ``get_decoder``): its output's first item is
    the final hidden states, after the last norm."""
    return inner_model(model).get_decoder()


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's generation_config EOS ids
    (Qwen2.5-Instruct stops at both <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(unwrap_model(model).generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)
