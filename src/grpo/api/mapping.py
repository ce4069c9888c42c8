"""The one mapping between TRL's ``GRPOConfig`` arguments and grpo's config tree, both ways.

``to_run_config`` is what ``GRPOTrainer`` trains with and what ``GRPOConfig.to_yaml`` writes;
``from_run_config`` reads a recipe back as arguments (the keys TRL has no name for travel in
``grpo_overrides``), so that ``from_run_config(cfg).to_run_config() == cfg``.

TRL counts optimizer updates; a grpo step is one rollout and ``num_iterations`` updates, so TRL's
``max_steps``/``save_steps``/``eval_steps``/``logging_steps`` are divided by ``num_iterations`` here.
"""

from __future__ import annotations

import math
from typing import Any

from grpo.api.arguments import GRPOConfig
from grpo.algorithm.advantages import ADVANTAGE_SCALES
from grpo.config import RunConfig, config_from_dict, config_to_dict
import torch
from grpo.config.kinds import TRACKERS, VLLM_ENGINE

OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def batch_shape(args: GRPOConfig, num_processes: int) -> tuple[int, int]:
    """(prompts per step over all ranks, completions per micro-batch): TRL's generation batch is
    ``per_device_train_batch_size x processes x steps_per_generation`` completions (steps_per_generation =
    gradient_accumulation_steps), ``num_generations`` per prompt."""
    B, GA, G = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations
    completions = B * num_processes * GA
    if args.generation_batch_size is not None and args.generation_batch_size != completions:
        raise ValueError(f"GRPOConfig.generation_batch_size={args.generation_batch_size} is not supported: grpo "
                         f"updates on each whole rollout, so it must be per_device_train_batch_size x processes x "
                         f"gradient_accumulation_steps = {B} x {num_processes} x {GA} = {completions}")
    if completions % G:
        raise ValueError(f"GRPOConfig: the generation batch ({B} x {num_processes} processes x {GA} accumulation "
                         f"steps = {completions} completions) is not divisible by num_generations {G}")
    return completions // G, B


def grpo_steps(args: GRPOConfig, prompts_per_step: int, train_size: int | None) -> int:
    """grpo's ``train.max_steps``: TRL's ``max_steps`` / num_iterations, or from ``num_train_epochs`` as TRL
    counts them (each epoch drops the prompts that do not fill a last generation)."""
    ni = args.num_iterations
    if args.max_steps > 0:
        if args.max_steps % ni:
            raise ValueError(f"GRPOConfig.max_steps={args.max_steps} is not a multiple of num_iterations {ni}: a "
                             "grpo step is one rollout and its num_iterations updates")
        return args.max_steps // ni
    if train_size is None:
        raise ValueError("GRPOConfig.max_steps=-1 counts steps from num_train_epochs and the train dataset's "
                         "length: pass train_size (GRPOTrainer does) or set max_steps")
    per_epoch = train_size // prompts_per_step
    if per_epoch == 0:
        raise ValueError(f"the train dataset has {train_size} prompts, fewer than one step's {prompts_per_step}")
    return max(1, math.ceil(math.ceil(args.num_train_epochs * per_epoch * ni) / ni))


def _per_step(value: float, ni: int, max_updates: int) -> int:
    """A TRL interval in updates (a float below 1: a share of max_steps) as grpo steps, rounded up."""
    updates = math.ceil(value * max_updates) if value < 1 else int(value)
    return max(1, math.ceil(updates / ni))


def _bf16(args: GRPOConfig) -> bool:
    dtype = str((args.model_init_kwargs or {}).get("dtype") or (args.model_init_kwargs or {}).get("torch_dtype"))
    if args.bf16 is not None:
        return bool(args.bf16) or dtype.endswith("bfloat16")

    return dtype.endswith("bfloat16") or (not args.use_cpu and torch.cuda.is_available()
                                           and torch.cuda.is_bf16_supported())


def to_run_config(args: GRPOConfig, *, num_processes: int = 1, train_size: int | None = None,
                  model: str | None = None, lora: dict | None = None, data: dict | None = None,
                  rewards: list[dict] | None = None, rollout: dict | None = None) -> RunConfig:
    """The checked ``RunConfig`` of ``args``. ``model``: the policy's path or hub id; ``lora``: ``model.lora_*``
    keys (a peft config's); ``data``: ``data.*`` keys the trainer derives from its datasets; ``rewards``: the
    ``rewards`` list; ``rollout``: ``rollout.*`` keys naming the trainer's tools/environment/rollout hook. A value
    grpo cannot take is a ``ValueError`` naming the argument."""
    P, B = batch_shape(args, num_processes)
    ni = args.num_iterations
    steps = grpo_steps(args, P, train_size)
    updates = steps * ni
    if args.lr_scheduler_type not in SCHEDULES:
        raise ValueError(f"GRPOConfig.lr_scheduler_type={args.lr_scheduler_type!r} is not supported: grpo has "
                         f"{sorted(SCHEDULES)}")
    if args.optim not in OPTIMIZERS:
        raise ValueError(f"GRPOConfig.optim={args.optim!r} is not supported: grpo has {sorted(OPTIMIZERS)}")
    warmup = 0 if args.lr_scheduler_type == "constant" else (  # TRL's constant schedule has no warm-up
        math.ceil(args.warmup_steps * updates) if args.warmup_steps < 1 else int(args.warmup_steps))
    report_to = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to)
    report_to = [] if report_to in ([], ["none"]) else ["tensorboard"] if report_to == ["all"] else report_to
    if set(report_to) - set(TRACKERS):
        raise ValueError(f"GRPOConfig.report_to={args.report_to!r} is not supported: grpo reports to "
                         f"{list(TRACKERS)} (or 'none')")
    scale = {True: None, False: "none", "group": None, "batch": "batch", "none": "none"}
    if args.scale_rewards not in scale:
        raise ValueError(f"GRPOConfig.scale_rewards={args.scale_rewards!r}: one of {', '.join(ADVANTAGE_SCALES)}")
    if args.use_vllm and args.rollout_engine not in (None, VLLM_ENGINE):
        raise ValueError(f"GRPOConfig: use_vllm=True and rollout_engine={args.rollout_engine!r} disagree")
    init = args.model_init_kwargs or {}
    tree: dict[str, Any] = {
        "model": {"bf16": _bf16(args), "gradient_checkpointing": args.gradient_checkpointing,
                  "trust_remote_code": bool(args.trust_remote_code or init.get("trust_remote_code")),
                  "attn_implementation": init.get("attn_implementation"), **({"name_or_path": model} if model else {}),
                  **{f"lora_{k}": v for k, v in (lora or {}).items()}},
        "data": {"shuffle": args.shuffle_dataset, **(data or {})},
        "rollout": {"num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                    "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k or None,
                    "min_p": args.min_p or 0.0, "repetition_penalty": args.repetition_penalty,
                    "min_new_tokens": (args.generation_kwargs or {}).get("min_new_tokens", 0),
                    "engine": VLLM_ENGINE if args.use_vllm else args.rollout_engine or "auto",
                    "vllm_enable_sleep_mode": args.vllm_enable_sleep_mode,
                    "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                    "dynamic_sampling": args.dynamic_sampling,
                    "max_tool_calling_iterations": args.max_tool_calling_iterations},
        "algorithm": {"advantage_estimator": args.advantage_estimator},
        "loss": {"beta": args.beta, "kl_times_ratio": args.use_bias_correction_kl, "num_iterations": ni, "epsilon": args.epsilon, "epsilon_high": args.epsilon_high,
                 "importance_sampling_level": args.importance_sampling_level, "scale_rewards": scale[args.scale_rewards],
                 "loss_type": args.loss_type, "mask_truncated_completions": args.mask_truncated_completions,
                 "sampler_is_correction": args.use_vllm and args.vllm_importance_sampling_correction,
                 "sampler_is_mode": args.vllm_importance_sampling_mode,
                 "sampler_is_cap": args.vllm_importance_sampling_clip_max,
                 "sampler_is_min": args.vllm_importance_sampling_clip_min},
        "ptx": {"data": args.ptx_data, **({"coef": args.ptx_coef} if args.ptx_coef is not None else {})},
        "optim": {"learning_rate": args.learning_rate, "lr_scheduler_type": SCHEDULES[args.lr_scheduler_type],
                  "warmup_ratio": warmup / updates, "optimizer": OPTIMIZERS[args.optim],
                  "weight_decay": args.weight_decay, "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2,
                  "max_grad_norm": args.max_grad_norm or None},
        "train": {"prompts_per_step": P, "micro_batch_size": B, "max_steps": steps,
                  "output_dir": args.output_dir or "trainer_output", "overwrite": True,  # as TRL writes
                  "seed": args.seed, "save_steps": _per_step(args.save_steps, ni, updates),
                  "save_total_limit": args.save_total_limit, "device": "cpu" if args.use_cpu else "auto",
                  "eval_steps": (_per_step(args.eval_steps or args.logging_steps, ni, updates)
                                 if args.eval_strategy == "steps" else None),
                  "eval_on_start": args.eval_on_start, "checkpoint_layout": "trl",
                  "eval_at_end": False,  # TRL evaluates the last step inside it
                  "save_final": args.save_final_model},
        "log": {"logging_steps": _per_step(args.logging_steps, ni, updates), "report_to": report_to,
                "progress_bar": not args.disable_tqdm, "plots": args.plot_at_end},
    }
    if rewards is not None:
        tree["rewards"] = rewards
    tree["rollout"].update(rollout or {})
    for key, value in args.grpo_overrides.items():
        _set(tree, key, value)
    return config_from_dict(tree, "GRPOConfig")


def _set(tree: dict, dotted: str, value: Any) -> None:
    *sections, last = dotted.split(".")
    for name in sections:
        tree = tree.setdefault(name, {})
    tree[last] = value


def _flat(tree: dict) -> dict[str, Any]:
    """``{"loss": {"beta": 0.1}, "rewards": [...]}`` -> ``{"loss.beta": 0.1, "rewards": [...]}``."""
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{key}": v for key, v in value.items()})
        else:
            flat[name] = value
    return flat


def from_run_config(cfg: RunConfig) -> GRPOConfig:
    """TRL-named arguments for a grpo config, with every key TRL cannot say in ``grpo_overrides``."""
    t, r, loss, o, m = cfg.train, cfg.rollout, cfg.loss, cfg.optim, cfg.model
    ni = loss.num_iterations
    updates = t.max_steps * ni
    args = GRPOConfig(
        output_dir=t.output_dir, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.prompts_per_step * r.num_generations // t.micro_batch_size,
        num_generations=r.num_generations, max_steps=updates, learning_rate=o.learning_rate,
        lr_scheduler_type=("constant_with_warmup" if o.lr_scheduler_type == "constant" and o.warmup_ratio
                           else o.lr_scheduler_type),
        warmup_steps=int(round(o.warmup_ratio * updates)),
        optim="adamw_torch" if o.optimizer == "adamw" else "adamw_8bit", weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, max_grad_norm=o.max_grad_norm or 0.0, bf16=m.bf16,
        gradient_checkpointing=m.gradient_checkpointing, seed=t.seed, use_cpu=t.device == "cpu",
        trust_remote_code=m.trust_remote_code, max_completion_length=r.max_completion_length,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k or 0, min_p=r.min_p or None,
        repetition_penalty=r.repetition_penalty, shuffle_dataset=cfg.data.shuffle, use_vllm=r.engine == VLLM_ENGINE,
        rollout_engine=None if r.engine == VLLM_ENGINE else r.engine, beta=loss.beta, num_iterations=ni,
        epsilon=loss.epsilon, epsilon_high=loss.epsilon_high, importance_sampling_level=loss.importance_sampling_level,
        scale_rewards=loss.scale_rewards or "group", loss_type=loss.loss_type,
        mask_truncated_completions=loss.mask_truncated_completions, use_bias_correction_kl=loss.kl_times_ratio,
        vllm_importance_sampling_correction=loss.sampler_is_correction, vllm_importance_sampling_mode=loss.sampler_is_mode,
        vllm_importance_sampling_clip_max=loss.sampler_is_cap, vllm_importance_sampling_clip_min=loss.sampler_is_min,
        logging_steps=cfg.log.logging_steps * ni, report_to=list(cfg.log.report_to) or "none",
        disable_tqdm=not cfg.log.progress_bar, save_steps=t.save_steps * ni, save_total_limit=t.save_total_limit,
        eval_strategy="steps" if t.eval_steps else "no", eval_steps=(t.eval_steps or 0) * ni or None,
        eval_on_start=t.eval_on_start, advantage_estimator=cfg.algorithm.advantage_estimator,
        dynamic_sampling=r.dynamic_sampling, ptx_data=cfg.ptx.data, ptx_coef=cfg.ptx.coef if cfg.ptx.data else None,
        save_final_model=t.save_final, plot_at_end=cfg.log.plots)
    want = _flat(config_to_dict(cfg))
    got = _flat(config_to_dict(to_run_config(args)))
    args.grpo_overrides = {key: value for key, value in want.items() if got.get(key) != value}
    return args
