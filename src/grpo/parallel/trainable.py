"""The policy with what updates it: optimizer, schedule and learner (torch/DDP, DeepSpeed or FSDP2), built from the
config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import ConfigError, RunConfig
from grpo.config.rules import updates_per_step
from grpo.models.compiled import CompiledDecoder, CompileSettings
from grpo.models.precision import loss_scaler
from grpo.parallel.distributed import DistInfo, one_process_group
from grpo.parallel.fsdp import FsdpLearner, FsdpSettings, check_fsdp_available, device_mesh, layer_modules, shard
from grpo.parallel.learners import Learner, build_learner, deepspeed_config
from grpo.parallel.optim import build_optimizer, build_scheduler


@dataclass
class Trainable:
    """The policy and what updates it. ``optimizer``/``scheduler`` are None under DeepSpeed (the engine owns them);
    under FSDP2 (``fsdp``) the policy's parameters are each rank's shards. ``scaler``: fp16's loss scaler on the
    torch path (checkpointed with them), else None."""

    policy: torch.nn.Module
    learner: Learner
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    deepspeed: bool
    fsdp: bool = False
    scaler: torch.amp.GradScaler | None = None


def compile_settings(cfg: RunConfig) -> CompileSettings | None:
    """``train.torch_compile``'s settings, None when it is off."""
    t = cfg.train
    return CompileSettings(t.torch_compile_backend, t.torch_compile_mode) if t.torch_compile else None


def fsdp_settings(cfg: RunConfig) -> FsdpSettings:
    """``shard``'s settings from ``train.fsdp``'s section: under ``model.bf16`` units are gathered and computed in
    bf16 over fp32 shards (the master weights), gradients reduced in ``fsdp.reduce_dtype``."""
    f = cfg.fsdp
    bf16 = cfg.model.bf16
    return FsdpSettings(layer_classes=tuple(f.layer_classes), param_dtype=torch.bfloat16 if bf16 else None,
                        reduce_dtype=getattr(torch, f.reduce_dtype) if bf16 else None, cpu_offload=f.cpu_offload,
                        reshard_after_forward=f.reshard_after_forward, accumulate_unsharded=f.accumulate_unsharded)


def shard_for_run(cfg: RunConfig, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded over the run's ranks as ``train.fsdp`` says (the policy before its optimizer is built, or the
    frozen reference); a process alone gets a process group of its own. ConfigError (torch without FSDP2, no layer
    class found) before anything is written."""
    check_fsdp_available()
    settings = fsdp_settings(cfg)
    layer_modules(model, settings.layer_classes)  # a model without them fails before any process group exists
    device_type = next(model.parameters()).device.type
    one_process_group(device_type)
    return shard(model, settings, device_mesh(device_type))


def build_trainable(cfg: RunConfig, policy: torch.nn.Module, info: DistInfo,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: object | None = None) -> Trainable:
    """Optimizer, schedule and learner (DeepSpeed when ``train.deepspeed`` names a config, FSDP2 with ``train.fsdp``,
    else torch/DDP, with fp16's loss scaler and the compiled decoder of ``train.torch_compile``).
    ``optimizer``/``scheduler``: a caller's, used as given (None: built from ``optim.*``; a given optimizer
    without a scheduler gets ``optim.*``'s schedule over it, as transformers' Trainer does)."""
    if cfg.train.fsdp and optimizer is not None:
        raise ConfigError("train.fsdp: a given optimizer (GRPOTrainer(optimizers=...)) holds the model's parameters "
                          "as they were before sharding; under FSDP2 the optimizer is built over the shards (drop "
                          "optimizers=, or train.fsdp)")
    if cfg.train.fsdp:  # sharded first: the optimizer holds the shards
        shard_for_run(cfg, policy)
    if optimizer is None:
        optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0,
                                    allow_fused=not (cfg.train.deepspeed or cfg.train.fsdp))
    if scheduler is None:
        # The schedule moves once per optimizer update: max_steps x num_iterations x mini_batches of them.
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps * updates_per_step(cfg))
    if cfg.train.fsdp:
        learner = FsdpLearner(policy, optimizer, scheduler, cfg.optim.max_grad_norm, cfg.fsdp.accumulate_unsharded)
        return Trainable(policy, learner, optimizer, scheduler, deepspeed=False, fsdp=True)
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
