"""The policy with what updates it: optimizer, schedule and learner (torch/DDP or DeepSpeed), built from the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import RunConfig
from grpo.models.compiled import CompiledDecoder, CompileSettings
from grpo.models.precision import loss_scaler
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import Learner, build_learner, deepspeed_config
from grpo.parallel.optim import build_optimizer, build_scheduler


@dataclass
class Trainable:
    """The policy and what updates it. ``optimizer``/``scheduler`` are None under DeepSpeed (the engine owns them);
    ``scaler``: fp16's loss scaler on the torch path (checkpointed with them), else None."""

    policy: torch.nn.Module
    learner: Learner
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    deepspeed: bool
    scaler: torch.amp.GradScaler | None = None


def compile_settings(cfg: RunConfig) -> CompileSettings | None:
    """``train.torch_compile``'s settings, None when it is off."""
    t = cfg.train
    return CompileSettings(t.torch_compile_backend, t.torch_compile_mode) if t.torch_compile else None


def build_trainable(cfg: RunConfig, policy: torch.nn.Module, info: DistInfo) -> Trainable:
    """Optimizer, schedule and learner (DeepSpeed when ``train.deepspeed`` names a config, else torch/DDP, with
    fp16's loss scaler and the compiled decoder of ``train.torch_compile``)."""
    optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0,
                                allow_fused=not cfg.train.deepspeed)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps * cfg.loss.num_iterations)
    ds_config = None
    if cfg.train.deepspeed:
        completions_per_rank = cfg.train.prompts_per_step * cfg.rollout.num_generations // info.world_size
        ds_config = deepspeed_config(
            cfg.train.deepspeed, micro_batch_size=cfg.train.micro_batch_size,
            # + 1 with PTX: its micro-batch's backward comes before each update too (see train_on_batch), and
            # DeepSpeed steps at its own count of backwards.
            accumulation_steps=max(1, completions_per_rank // cfg.train.micro_batch_size) + bool(cfg.ptx.data),
            world_size=info.world_size, max_grad_norm=cfg.optim.max_grad_norm, bf16=cfg.model.bf16,
            fp16=cfg.model.fp16)
    device = next(policy.parameters()).device
    scaler = loss_scaler(cfg.model, device, deepspeed=ds_config is not None)
    settings = compile_settings(cfg)
    compiled = CompiledDecoder(policy, settings) if settings is not None else None
    learner = build_learner(policy, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=ds_config,
                            max_grad_norm=cfg.optim.max_grad_norm, scaler=scaler, compiled=compiled)
    if ds_config is not None:
        return Trainable(policy, learner, None, None, deepspeed=True)
    return Trainable(policy, learner, optimizer, scheduler, deepspeed=False, scaler=scaler)
