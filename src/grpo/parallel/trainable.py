"""The policy with what updates it: optimizer, schedule and learner (torch/DDP or DeepSpeed), built from the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import RunConfig
from grpo.config.rules import updates_per_step
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import Learner, build_learner, deepspeed_config
from grpo.parallel.optim import build_optimizer, build_scheduler


@dataclass
class Trainable:
    """The policy and what updates it. ``optimizer``/``scheduler`` are None under DeepSpeed (the engine owns them)."""

    policy: torch.nn.Module
    learner: Learner
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    deepspeed: bool


def build_trainable(cfg: RunConfig, policy: torch.nn.Module, info: DistInfo,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: object | None = None) -> Trainable:
    """Optimizer, schedule and learner (DeepSpeed when ``train.deepspeed`` names a config, else torch/DDP).
    ``optimizer``/``scheduler``: a caller's, used as given (None: built from ``optim.*``; a given optimizer without a
    scheduler gets ``optim.*``'s schedule over it, as transformers' Trainer does)."""
    if optimizer is None:
        optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0,
                                    allow_fused=not cfg.train.deepspeed)
    if scheduler is None:
        # The schedule moves once per optimizer update: max_steps x num_iterations x mini_batches of them.
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps * updates_per_step(cfg))
    ds_config = None
    if cfg.train.deepspeed:
        # One update's rows on this rank: its share of one mini-batch (the whole step with train.mini_batches 1).
        rows = cfg.train.prompts_per_step * cfg.rollout.num_generations // info.world_size // cfg.train.mini_batches
        ds_config = deepspeed_config(
            cfg.train.deepspeed, micro_batch_size=cfg.train.micro_batch_size,
            # Its micro-batches, as token_budget_micro_batches cuts fixed rows (a short last one counts); + 1 with
            # PTX: its micro-batch's backward comes before each update too (see train_on_batch), and DeepSpeed
            # steps at its own count of backwards.
            accumulation_steps=max(1, -(-rows // cfg.train.micro_batch_size)) + bool(cfg.ptx.data),
            world_size=info.world_size, max_grad_norm=cfg.optim.max_grad_norm, bf16=cfg.model.bf16)
    learner = build_learner(policy, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=ds_config,
                            max_grad_norm=cfg.optim.max_grad_norm)
    if ds_config is not None:
        return Trainable(policy, learner, None, None, deepspeed=True)
    return Trainable(policy, learner, optimizer, scheduler, deepspeed=False)
