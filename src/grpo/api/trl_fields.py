"""The one table between TRL 1.16's ``GRPOConfig`` fields and grpo: ``LINKS`` (a TRL field, the grpo config keys it
sets and the conversion each way: a field is added here with its link, once), ``ACCEPTED_AS_IS`` (fields that cannot
change what a run computes) and ``UNSUPPORTED`` (the short list grpo refuses, each with why and what to set
instead). tests/api/test_trl_fields.py holds it against TRL's own ``dataclasses.fields(GRPOConfig)``: every TRL field
is in exactly one of them. ``grpo.api.mapping`` reads the links both ways; nothing here imports the arguments'
class (its values arrive by field name)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo.api.fsdp_arguments import fsdp_arguments, fsdp_keys
from grpo.api.trl_batch import Counts, generation_shape, per_step_interval
from grpo.config.kinds import VLLM_ENGINE
from grpo.models.precision import tf32_available

OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
             "cosine_with_min_lr": "cosine_with_min_lr"}
SCALE_REWARDS = {True: None, False: "none", "group": None, "batch": "batch", "none": "none"}


def _bf16(bf16: bool | None, init: dict | None, use_cpu: bool, fp16: bool = False) -> bool:
    """``model.bf16`` of TRL's ``bf16``, ``model_init_kwargs``, ``use_cpu`` and ``fp16`` (TRL: bf16 None is
    ``not fp16``)."""
    dtype = str((init or {}).get("dtype") or (init or {}).get("torch_dtype"))
    if bf16 is not None:
        return bool(bf16) or dtype.endswith("bfloat16")
    return dtype.endswith("bfloat16") or (not fp16 and not use_cpu and torch.cuda.is_available()
                                           and torch.cuda.is_bf16_supported())


def _compiling(on: bool, backend: str | None, mode: str | None) -> bool:
    """TRL's ``torch_compile``: a backend or a mode turns it on."""
    return bool(on) or backend is not None or mode is not None


def _tf32(tf32: bool | None, compiling: bool, fp16: bool, use_cpu: bool) -> bool | None:
    """``model.tf32`` of TRL's ``tf32``: as given, or (None) on where transformers turns it on for torch.compile
    (a TF32 GPU, not fp16; not for a run on the CPU, where it would change nothing), else None (torch's own)."""
    if tf32 is not None or not compiling:
        return tf32
    return True if tf32_available() and not fp16 and not use_cpu else None


# Said once by GRPOTrainer when use_liger_kernel=True (TRL 1.16 computes its log-probs with its own fused LM head
# whatever use_liger_kernel says; that flag adds Liger's Triton layer kernels, which grpo does not have).
LIGER_NOTE = ("grpo: use_liger_kernel=True: log-probs come from grpo's chunked LM head (train.fused_lm_head: true), "
              "which never builds the [B, L, V] logits, as TRL's fused LM head; Liger's layer kernels (RoPE, "
              "RMSNorm, SwiGLU) are not applied")


OMIT = object()  # a ``Link.to`` value that leaves the key out of the tree (grpo's default then)


@dataclass(frozen=True)
class Link:
    """TRL arguments and the grpo keys they set, read both ways.

    ``to(counts, *argument values)``: the keys' values, in ``keys`` order (``OMIT``: leave it out);
    ``back(counts, *key values)``: ``{argument: value}`` for the arguments the keys say, or None when the keys
    are not read back (they travel in ``grpo_overrides`` where they differ from what the arguments give).
    """

    args: tuple[str, ...]
    keys: tuple[str, ...]
    to: Callable[..., tuple]
    back: Callable[..., dict[str, Any]] | None


def same(arg: str, key: str) -> Link:
    """``arg`` is ``key``'s value as it is."""
    return Link((arg,), (key,), lambda c, value: (value,), lambda c, value: {arg: value})


def one(arg: str, key: str, to: Callable[[Any], Any], back: Callable[[Any], Any] | None) -> Link:
    """``arg`` is ``key``'s value through ``to`` (and ``back``)."""
    return Link((arg,), (key,), lambda c, value: (to(value),),
                None if back is None else (lambda c, value: {arg: back(value)}))


def forward(arg: str, key: str, to: Callable[[Any], Any] = lambda value: value) -> Link:
    """``arg`` sets ``key`` (through ``to``), but a recipe's ``key`` is not read back into ``arg``."""
    return one(arg, key, to, None)


def fixed(key: str, value: Any) -> Link:
    """A key TRL's trainer always runs with ``value`` (not read back)."""
    return Link((), (key,), lambda c: (value,), None)


def _warmup_ratio(c: Counts, schedule: str, warmup_steps: float) -> float:
    warmup = 0 if schedule == "constant" else (  # TRL's constant schedule has no warm-up
        math.ceil(warmup_steps * c.updates) if warmup_steps < 1 else int(warmup_steps))
    return warmup / c.updates


def _batch_keys(c: Counts, B: int, GA: int, G: int, spg: int | None, gbs: int | None) -> tuple[int, int, int, int]:
    """(train.micro_batch_size, train.prompts_per_step, rollout.num_generations, train.mini_batches) of TRL's batch
    arguments (``generation_shape``)."""
    prompts, mini_batches = generation_shape(B, GA, G, spg, gbs, c.processes)
    return B, prompts, G, mini_batches


FSDP_KEYS = ("train.fsdp", "fsdp.cpu_offload", "fsdp.reshard_after_forward", "fsdp.layer_classes",
             "model.gradient_checkpointing")


def _fsdp_values(fsdp, fsdp_config) -> tuple:
    keys = fsdp_keys(fsdp, fsdp_config)
    return tuple(keys.get(key, OMIT) for key in FSDP_KEYS)


def report_trackers(value: str | list[str]) -> list[str]:
    report_to = [value] if isinstance(value, str) else list(value)
    return [] if report_to in ([], ["none"]) else ["tensorboard"] if report_to == ["all"] else report_to


# In the config tree's order: model, data, rollout, algorithm, loss, ptx, optim, train, log.
LINKS: tuple[Link, ...] = (
    Link(("bf16", "model_init_kwargs", "use_cpu", "fp16"), ("model.bf16",),
         lambda c, bf16, init, cpu, fp16: (_bf16(bf16, init, cpu, fp16),), lambda c, bf16: {"bf16": bf16}),
    same("fp16", "model.fp16"),
    Link(("tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode", "fp16", "use_cpu"),
         ("model.tf32",),
         lambda c, tf32, on, backend, mode, fp16, cpu: (_tf32(tf32, _compiling(on, backend, mode), fp16, cpu),),
         lambda c, tf32: {"tf32": tf32}),
    # transformers >= 5.24 names it activation_checkpointing (gradient_checkpointing its deprecated alias)
    Link(("gradient_checkpointing", "activation_checkpointing"), ("model.gradient_checkpointing",),
         lambda c, old, new: (old if new is None else new,),
         lambda c, on: {"gradient_checkpointing": on, "activation_checkpointing": on}),
    Link(("trust_remote_code", "model_init_kwargs"), ("model.trust_remote_code",),
         lambda c, trust, init: (bool(trust or (init or {}).get("trust_remote_code")),),
         lambda c, trust: {"trust_remote_code": trust}),
    forward("model_init_kwargs", "model.attn_implementation", lambda init: (init or {}).get("attn_implementation")),
    same("disable_dropout", "model.disable_dropout"),
    same("cast_lm_head_to_fp32", "model.lm_head_fp32"),
    same("neftune_noise_alpha", "model.neftune_noise_alpha"),
    same("shuffle_dataset", "data.shuffle"),
    Link(("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "steps_per_generation",
          "generation_batch_size"),
         ("train.micro_batch_size", "train.prompts_per_step", "rollout.num_generations", "train.mini_batches"),
         _batch_keys,
         # P x G completions per generation, P x G / k per update: GA micro-batches of B (one process)
         lambda c, B, P, G, k: {"per_device_train_batch_size": B, "gradient_accumulation_steps": P * G // (B * k),
                                "num_generations": G, "steps_per_generation": P * G // B if k > 1 else None}),
    same("max_completion_length", "rollout.max_completion_length"),
    same("temperature", "rollout.temperature"),
    same("top_p", "rollout.top_p"),
    one("top_k", "rollout.top_k", lambda k: k or None, lambda k: k or 0),
    one("min_p", "rollout.min_p", lambda p: p or 0.0, lambda p: p or None),
    same("repetition_penalty", "rollout.repetition_penalty"),
    forward("generation_kwargs", "rollout.min_new_tokens", lambda kw: (kw or {}).get("min_new_tokens", 0)),
    Link(("use_vllm", "rollout_engine"), ("rollout.engine",),
         lambda c, vllm, engine: (VLLM_ENGINE if vllm else engine or "auto",),
         lambda c, engine: {"use_vllm": engine == VLLM_ENGINE, "rollout_engine": None if engine == VLLM_ENGINE else engine}),
    forward("vllm_enable_sleep_mode", "rollout.vllm_enable_sleep_mode"),
    forward("vllm_gpu_memory_utilization", "rollout.vllm_gpu_memory_utilization"),
    same("dynamic_sampling", "rollout.dynamic_sampling"),
    forward("max_tool_calling_iterations", "rollout.max_tool_calling_iterations"),
    same("advantage_estimator", "algorithm.advantage_estimator"),
    same("multi_objective_aggregation", "algorithm.multi_objective_aggregation"),
    same("beta", "loss.beta"),
    same("use_bias_correction_kl", "loss.kl_times_ratio"),
    # TRL counts the sync interval in updates (check_arguments: a multiple of a step's updates); its alpha means
    # nothing without sync_ref_model, so it is left out then
    Link(("sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha"),
         ("loss.ref_sync_steps", "loss.ref_mixup_alpha"),
         lambda c, sync, every, alpha: (every // c.per_step, alpha) if sync else (None, OMIT),
         lambda c, every, alpha: {"sync_ref_model": every is not None, "ref_model_mixup_alpha": alpha,
                                  "ref_model_sync_steps": 512 if every is None else every * c.per_step}),
    same("num_iterations", "loss.num_iterations"),
    same("epsilon", "loss.epsilon"),
    same("epsilon_high", "loss.epsilon_high"),
    same("importance_sampling_level", "loss.importance_sampling_level"),
    one("scale_rewards", "loss.scale_rewards", SCALE_REWARDS.__getitem__, lambda scale: scale or "group"),
    same("loss_type", "loss.loss_type"),
    same("mask_truncated_completions", "loss.mask_truncated_completions"),
    same("delta", "loss.delta"),
    same("sapo_temperature_pos", "loss.sapo_temperature_pos"),
    same("sapo_temperature_neg", "loss.sapo_temperature_neg"),
    same("vespo_k_pos", "loss.vespo_k_pos"),
    same("vespo_lambda_pos", "loss.vespo_lambda_pos"),
    same("vespo_k_neg", "loss.vespo_k_neg"),
    same("vespo_lambda_neg", "loss.vespo_lambda_neg"),
    same("top_entropy_quantile", "loss.top_entropy_quantile"),
    same("off_policy_mask_threshold", "loss.off_policy_mask_threshold"),
    same("entropy_coef", "loss.entropy_coef"),
    same("use_adaptive_entropy", "loss.adaptive_entropy"),
    same("entropy_target", "loss.entropy_target"),
    same("entropy_coef_delta", "loss.entropy_coef_delta"),
    same("entropy_coef_min", "loss.entropy_coef_min"),
    same("entropy_coef_max", "loss.entropy_coef_max"),
    same("router_aux_loss_coef", "loss.router_aux_loss_coef"),
    Link(("use_vllm", "vllm_importance_sampling_correction"), ("loss.sampler_is_correction",),
         lambda c, vllm, correction: (vllm and correction,),
         lambda c, correction: {"vllm_importance_sampling_correction": correction}),
    same("vllm_importance_sampling_mode", "loss.sampler_is_mode"),
    # TRL's deprecated vllm_importance_sampling_cap, when given, is the cap (its __post_init__ moves it there)
    Link(("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"), ("loss.sampler_is_cap",),
         lambda c, clip_max, cap: (clip_max if cap is None else cap,),
         lambda c, cap: {"vllm_importance_sampling_clip_max": cap}),
    same("vllm_importance_sampling_clip_min", "loss.sampler_is_min"),
    Link(("ptx_data", "ptx_coef"), ("ptx.data", "ptx.coef"),
         lambda c, data, coef: (data, OMIT if coef is None else coef),
         lambda c, data, coef: {"ptx_data": data, "ptx_coef": coef if data else None}),
    same("learning_rate", "optim.learning_rate"),
    Link(("lr_scheduler_type", "warmup_steps"), ("optim.lr_scheduler_type", "optim.warmup_ratio"),
         lambda c, schedule, warmup: (SCHEDULES[schedule], _warmup_ratio(c, schedule, warmup)),
         lambda c, schedule, ratio: {"lr_scheduler_type": ("constant_with_warmup" if schedule == "constant" and ratio
                                                           else schedule),
                                     "warmup_steps": int(round(ratio * c.updates))}),
    one("lr_scheduler_kwargs", "optim.lr_scheduler_kwargs", lambda kwargs: dict(kwargs or {}),
        lambda kwargs: dict(kwargs) or None),
    one("optim", "optim.optimizer", OPTIMIZERS.__getitem__,
        lambda optimizer: "adamw_torch" if optimizer == "adamw" else "adamw_8bit"),
    same("weight_decay", "optim.weight_decay"),
    same("adam_beta1", "optim.adam_beta1"),
    same("adam_beta2", "optim.adam_beta2"),
    same("adam_epsilon", "optim.adam_epsilon"),
    one("max_grad_norm", "optim.max_grad_norm", lambda norm: norm or None, lambda norm: norm or 0.0),
    Link(("max_steps",), ("train.max_steps",), lambda c, max_steps: (c.steps,),  # grpo_steps'
         lambda c, steps: {"max_steps": steps * c.per_step}),
    one("output_dir", "train.output_dir", lambda path: path or "trainer_output", lambda path: path),
    fixed("train.overwrite", True),  # as TRL writes
    same("seed", "train.seed"),
    same("full_determinism", "train.full_determinism"),
    Link(("save_strategy", "save_steps"), ("train.save_strategy", "train.save_steps"),
         lambda c, strategy, every: (strategy, per_step_interval(every, c.per_step, c.updates)),
         lambda c, strategy, every: {"save_strategy": strategy, "save_steps": every * c.per_step}),
    same("save_total_limit", "train.save_total_limit"),
    one("use_cpu", "train.device", lambda cpu: "cpu" if cpu else "auto", lambda device: device == "cpu"),
    Link(("use_liger_kernel",), ("train.fused_lm_head",), lambda c, liger: (True if liger else OMIT,), None),
    Link(("torch_compile", "torch_compile_backend", "torch_compile_mode"),
         ("train.torch_compile", "train.torch_compile_backend", "train.torch_compile_mode"),
         lambda c, on, backend, mode: (_compiling(on, backend, mode), backend, mode),
         lambda c, on, backend, mode: {"torch_compile": on, "torch_compile_backend": backend,
                                       "torch_compile_mode": mode}),
    Link(("eval_strategy", "eval_steps", "logging_steps"), ("train.eval_strategy", "train.eval_steps"),
         lambda c, strategy, every, logging: ("epoch" if strategy == "epoch" else "steps",
                                              per_step_interval(every or logging, c.per_step, c.updates)
                                              if strategy == "steps" else None),
         lambda c, strategy, every: {"eval_strategy": "epoch" if strategy == "epoch" else "steps" if every else "no",
                                     "eval_steps": (every or 0) * c.per_step or None}),
    same("eval_on_start", "train.eval_on_start"),
    fixed("train.checkpoint_layout", "trl"),
    fixed("train.eval_at_end", False),  # TRL evaluates the last step inside it
    fixed("eval.loss_pass", True),  # TRL's evaluation runs its loss on sampled groups (eval_loss)
    same("num_generations_eval", "eval.num_generations"),
    same("per_device_eval_batch_size", "eval.loss_batch_size"),
    same("save_final_model", "train.save_final"),
    same("deepspeed", "train.deepspeed"),
    # after gradient_checkpointing's link: fsdp_config's activation_checkpointing sets it too
    Link(("fsdp", "fsdp_config"), FSDP_KEYS, lambda c, fsdp, config: _fsdp_values(fsdp, config),
         lambda c, on, offload, reshard, classes, _checkpointing: fsdp_arguments(on, offload, reshard, classes)),
    Link(("logging_strategy", "logging_steps"), ("log.logging_strategy", "log.logging_steps"),
         lambda c, strategy, every: (strategy, per_step_interval(every, c.per_step, c.updates)),
         lambda c, strategy, every: {"logging_strategy": strategy, "logging_steps": every * c.per_step}),
    one("report_to", "log.report_to", report_trackers, lambda trackers: list(trackers) or "none"),
    one("disable_tqdm", "log.progress_bar", lambda disable: not disable, lambda progress: not progress),
    same("plot_at_end", "log.plots"),
)


# Fields grpo does not implement: (TRL's default, why). Setting one to anything else is a ValueError.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "vllm_mode": ("colocate", (
        "a vLLM sampler on devices of its own is grpo's decoupled mode, which its launcher starts as processes that "
        "import the data and rewards by name, not from a script's objects; the same setup: write the recipe "
        "(args.to_yaml('run.yaml'), with data.train a data source and the rewards as module:function names in "
        "grpo_overrides) and run `grpo train run.yaml train.mode=decoupled rollout.engine=vllm "
        "decoupled.sampler_device=cuda:1` (the trainer on cuda:0, vLLM on cuda:1, as trl vllm-serve on its own GPU); "
        "or keep vllm_mode='colocate'")),
    "vllm_structured_outputs_regex": (None, "grpo's engines have no constrained decoding (vLLM's guided decoding is "
                                            "not wired into grpo's vLLM engine); score the format with a reward "
                                            "(format_think_answer, strict_format) instead"),
    "vllm_tensor_parallel_size": (1, "grpo's vLLM engine runs on one device (tensor parallelism over several GPUs "
                                     "is not built); several samplers, one GPU each, are train.mode decoupled with "
                                     "decoupled.num_samplers"),
    "log_completions_hub_repo": (None, "grpo writes samples to samples.jsonl, never to the Hub"),
    "push_to_hub": (False, "grpo never uploads; save_model() and push the folder yourself"),
    "auto_find_batch_size": (False, "the generation batch must hold whole groups of num_generations, which shrinking "
                                    "it on out-of-memory breaks (TRL refuses it too); lower "
                                    "per_device_train_batch_size"),
    "parallelism_config": (None, "accelerate's tensor and context parallelism over several GPUs are not built; shard "
                                 "with fsdp= (FSDP2) or deepspeed= (ZeRO), data-parallel ranks with torchrun or "
                                 "accelerate launch"),
}
# Fields the trainer reads itself, not through a config key: where each goes.
READ_BY_THE_TRAINER: dict[str, str] = {
    "reward_weights": "the weights of reward_funcs (grpo.api.rewards)",
    "liger_kernel_config": "refused where it turns one of Liger's kernels on (grpo.api.arguments)",
    "remove_unused_columns": "True: the rewards get no dataset columns (grpo.api.datasets)",
    "chat_template_kwargs": "set in a copy of the tokenizer's chat template (grpo.api.trainer)",
    "log_completions": "the completions table of each logged step (grpo.api.completions)",
    "logging_first_step": "a log entry at global step 1 (grpo.api.callbacks)",
    "num_train_epochs": "train.max_steps from the dataset's length when max_steps is -1 (grpo.api.trl_batch)",
    "load_best_model_at_end": "Trainer's best checkpoint loaded at the end (grpo.api.callbacks)",
    "metric_for_best_model": "the evaluation metric of the best checkpoint (grpo.api.arguments.best_model_arguments)",
    "greater_is_better": "the best checkpoint's direction (grpo.api.arguments.best_model_arguments)",
    "optim_args": "parsed as transformers parses it; transformers' AdamW takes nothing from it "
                  "(grpo.api.arguments.optimizer_arguments)",
}

ACCEPTED_AS_IS = (  # cannot change what a run computes
    "use_transformers_paged",  # TRL's deprecated name of use_transformers_continuous_batching (accepted too)
    "optim_target_modules",  # read by transformers for GaLore/APOLLO only; grpo's AdamW takes nothing from it
    "ds3_gather_for_generation", "pad_to_multiple_of", "cache_implementation", "vllm_model_impl",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_max_model_length", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "gradient_checkpointing_kwargs", "data_seed", "dataloader_drop_last",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "run_name", "project", "logging_dir",
    "logging_nan_inf_filter", "include_num_input_tokens_seen", "save_only_model", "torch_empty_cache_steps",
    "ddp_find_unused_parameters", "ddp_timeout", "log_level", "overwrite_output_dir", "log_on_each_node",
    "log_level_replica", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "eval_delay",
    "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
    "include_for_metrics", "batch_eval_metrics", "save_on_each_node", "hub_always_push", "hub_revision",
    "ignore_data_skip", "restore_callback_states_from_checkpoint",
    "dataloader_multiprocessing_context", "dataloader_in_order", "label_names", "length_column_name",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "skip_memory_metrics",
    "do_train", "do_eval", "do_predict", "local_rank", "debug", "average_tokens_across_devices", "use_cache",
    "bf16_full_eval", "fp16_full_eval", "label_smoothing_factor", "train_sampling_strategy", "accelerator_config",
    "resume_from_checkpoint", "enable_jit_checkpoint", "activation_checkpointing_kwargs",
)
