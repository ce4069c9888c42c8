"""The optimizer and its schedule: AdamW (torch, fused on CUDA, or bitsandbytes 8-bit) with LoRA's own
learning rate, and linear warm-up followed by a decay of ``LR_SCHEDULES`` (with its ``lr_scheduler_kwargs``)."""

from __future__ import annotations

import torch

from grpo.algorithm.lookup import lookup
from grpo.algorithm.schedules import LR_SCHEDULES, decay_arguments
from grpo.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lora: bool, allow_fused: bool = True) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on biases and norms (as HF Trainer).

    Fused (one kernel for every parameter's update, and no host-side reads of the step counters) when
    all trainable parameters are floating-point CUDA tensors; ``allow_fused=False`` for DeepSpeed,
    which moves the optimizer onto its own flat (maybe CPU-offloaded) copies of the parameters.
    """
    lr = (cfg.lora_learning_rate or cfg.learning_rate) if lora else cfg.learning_rate
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    if cfg.optimizer == "adamw_8bit":  # bitsandbytes (checked by models.check_memory_savers): 2 B of states/param
        import bitsandbytes as bnb  # optional: only 8-bit optimizers and 4-bit loading need it

        return bnb.optim.AdamW8bit(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    trainable = decay + no_decay
    # The for-each AdamW launches several kernels per parameter group and reads each step counter on
    # the host; the fused one does the whole update in a few kernels. It exists for CUDA (and here is
    # only asked for there): on the CPU the default stays, so CPU runs are unchanged.
    fused = allow_fused and bool(trainable) and all(p.is_cuda and p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             fused=fused or None)


def lr_multiplier(update: int, total_updates: int, warmup_updates: int, kind: str,
                  arguments: dict[str, float] | None = None) -> float:
    """Learning-rate factor for optimizer update ``update`` (0-based): linear warm-up to 1, then the decay
    ``kind`` of ``LR_SCHEDULES`` (with its ``arguments``: ``decay_arguments``') to the last of ``total_updates``.
    The warm-up's first update already gets 1/warmup (transformers' starts at 0, an update that does nothing)."""
    decay = lookup(LR_SCHEDULES, "lr_scheduler_type", kind)
    if update < warmup_updates:
        return (update + 1) / warmup_updates
    return decay.fn((update - warmup_updates) / max(1, total_updates - warmup_updates), **(arguments or {}))


def build_scheduler(optimizer, cfg: OptimConfig, total_updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up then decay over ``total_updates`` optimizer updates (see ``lr_multiplier``); the decay's arguments
    are ``cfg.lr_scheduler_kwargs`` (a ``min_lr`` is a share of the optimizer's peak rate, as transformers takes it)."""
    warmup = int(round(cfg.warmup_ratio * total_updates))
    arguments = decay_arguments(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs, optimizer.defaults["lr"],
                                "optim.lr_scheduler_kwargs")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: lr_multiplier(update, total_updates, warmup, cfg.lr_scheduler_type, arguments))
