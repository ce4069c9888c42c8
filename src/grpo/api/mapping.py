"""The one mapping between TRL's ``GRPOConfig`` arguments and grpo's config tree, both ways.

``to_run_config`` is what ``GRPOTrainer`` trains with and what ``GRPOConfig.to_yaml`` writes;
``trl_values`` (with ``untranslated_keys``) reads a recipe back as arguments (the keys TRL has no name for
travel in ``grpo_overrides``), so that ``GRPOConfig.from_run_config(cfg).to_run_config() == cfg``. Both read one
table, ``LINKS``:
each entry names TRL arguments, the grpo keys they set, and the conversion each way.

TRL counts optimizer updates; a grpo step is one rollout and ``num_iterations`` updates, so TRL's
``max_steps``/``save_steps``/``eval_steps``/``logging_steps`` are divided by ``num_iterations`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable

import torch

from grpo.algorithm.advantages import ADVANTAGE_SCALES
from grpo.config import RunConfig, config_from_dict, config_to_dict
from grpo.config.kinds import TRACKERS, VLLM_ENGINE
from grpo.models.precision import tf32_available

if TYPE_CHECKING:
    from grpo.api.arguments import GRPOConfig

OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
SCALE_REWARDS = {True: None, False: "none", "group": None, "batch": "batch", "none": "none"}


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


@dataclass(frozen=True)
class Counts:
    """What converts TRL's counts to grpo's and back: ``processes`` (ranks; 1 reading a recipe back), ``ni``
    (updates per grpo step: num_iterations), ``steps`` (grpo steps) and ``updates`` (steps x ni)."""

    processes: int
    ni: int
    steps: int
    updates: int


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


def _report_to(value: str | list[str]) -> list[str]:
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
    same("gradient_checkpointing", "model.gradient_checkpointing"),
    Link(("trust_remote_code", "model_init_kwargs"), ("model.trust_remote_code",),
         lambda c, trust, init: (bool(trust or (init or {}).get("trust_remote_code")),),
         lambda c, trust: {"trust_remote_code": trust}),
    forward("model_init_kwargs", "model.attn_implementation", lambda init: (init or {}).get("attn_implementation")),
    same("shuffle_dataset", "data.shuffle"),
    Link(("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"),
         ("train.micro_batch_size", "train.prompts_per_step", "rollout.num_generations"),
         lambda c, B, GA, G: (B, B * c.processes * GA // G, G),  # batch_shape's arithmetic
         lambda c, B, P, G: {"per_device_train_batch_size": B, "gradient_accumulation_steps": P * G // B,
                             "num_generations": G}),
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
    Link(("use_vllm", "vllm_importance_sampling_correction"), ("loss.sampler_is_correction",),
         lambda c, vllm, correction: (vllm and correction,),
         lambda c, correction: {"vllm_importance_sampling_correction": correction}),
    same("vllm_importance_sampling_mode", "loss.sampler_is_mode"),
    same("vllm_importance_sampling_clip_max", "loss.sampler_is_cap"),
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
    one("optim", "optim.optimizer", OPTIMIZERS.__getitem__,
        lambda optimizer: "adamw_torch" if optimizer == "adamw" else "adamw_8bit"),
    same("weight_decay", "optim.weight_decay"),
    same("adam_beta1", "optim.adam_beta1"),
    same("adam_beta2", "optim.adam_beta2"),
    one("max_grad_norm", "optim.max_grad_norm", lambda norm: norm or None, lambda norm: norm or 0.0),
    Link(("max_steps",), ("train.max_steps",), lambda c, max_steps: (c.steps,),  # grpo_steps'
         lambda c, steps: {"max_steps": steps * c.ni}),
    one("output_dir", "train.output_dir", lambda path: path or "trainer_output", lambda path: path),
    fixed("train.overwrite", True),  # as TRL writes
    same("seed", "train.seed"),
    Link(("save_steps",), ("train.save_steps",), lambda c, every: (_per_step(every, c.ni, c.updates),),
         lambda c, every: {"save_steps": every * c.ni}),
    same("save_total_limit", "train.save_total_limit"),
    one("use_cpu", "train.device", lambda cpu: "cpu" if cpu else "auto", lambda device: device == "cpu"),
    Link(("use_liger_kernel",), ("train.fused_lm_head",), lambda c, liger: (True if liger else OMIT,), None),
    Link(("torch_compile", "torch_compile_backend", "torch_compile_mode"),
         ("train.torch_compile", "train.torch_compile_backend", "train.torch_compile_mode"),
         lambda c, on, backend, mode: (_compiling(on, backend, mode), backend, mode),
         lambda c, on, backend, mode: {"torch_compile": on, "torch_compile_backend": backend,
                                       "torch_compile_mode": mode}),
    Link(("eval_strategy", "eval_steps", "logging_steps"), ("train.eval_steps",),
         lambda c, strategy, every, logging: (_per_step(every or logging, c.ni, c.updates)
                                              if strategy == "steps" else None,),
         lambda c, every: {"eval_strategy": "steps" if every else "no", "eval_steps": (every or 0) * c.ni or None}),
    same("eval_on_start", "train.eval_on_start"),
    fixed("train.checkpoint_layout", "trl"),
    fixed("train.eval_at_end", False),  # TRL evaluates the last step inside it
    fixed("eval.loss_pass", True),  # TRL's evaluation runs its loss on sampled groups (eval_loss)
    same("per_device_eval_batch_size", "eval.loss_batch_size"),
    same("save_final_model", "train.save_final"),
    Link(("logging_steps",), ("log.logging_steps",), lambda c, every: (_per_step(every, c.ni, c.updates),),
         lambda c, every: {"logging_steps": every * c.ni}),
    one("report_to", "log.report_to", _report_to, lambda trackers: list(trackers) or "none"),
    one("disable_tqdm", "log.progress_bar", lambda disable: not disable, lambda progress: not progress),
    same("plot_at_end", "log.plots"),
)


def check_arguments(args: GRPOConfig) -> None:
    """The values of ``args`` grpo cannot take (beyond ``batch_shape``'s and ``grpo_steps``'): a ``ValueError``
    naming the argument."""
    if args.lr_scheduler_type not in SCHEDULES:
        raise ValueError(f"GRPOConfig.lr_scheduler_type={args.lr_scheduler_type!r} is not supported: grpo has "
                         f"{sorted(SCHEDULES)}")
    if args.optim not in OPTIMIZERS:
        raise ValueError(f"GRPOConfig.optim={args.optim!r} is not supported: grpo has {sorted(OPTIMIZERS)}")
    if set(_report_to(args.report_to)) - set(TRACKERS):
        raise ValueError(f"GRPOConfig.report_to={args.report_to!r} is not supported: grpo reports to "
                         f"{list(TRACKERS)} (or 'none')")
    if args.scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"GRPOConfig.scale_rewards={args.scale_rewards!r}: one of {', '.join(ADVANTAGE_SCALES)}")
    if args.use_vllm and args.rollout_engine not in (None, VLLM_ENGINE):
        raise ValueError(f"GRPOConfig: use_vllm=True and rollout_engine={args.rollout_engine!r} disagree")


def to_run_config(args: GRPOConfig, *, num_processes: int = 1, train_size: int | None = None,
                  model: str | None = None, lora: dict | None = None, data: dict | None = None,
                  rewards: list[dict] | None = None, rollout: dict | None = None) -> RunConfig:
    """The checked ``RunConfig`` of ``args`` (``LINKS`` read forwards). ``model``: the policy's path or hub id;
    ``lora``: ``model.lora_*`` keys (a peft config's); ``data``: ``data.*`` keys the trainer derives from its
    datasets; ``rewards``: the ``rewards`` list; ``rollout``: ``rollout.*`` keys naming the trainer's
    tools/environment/rollout hook. A value grpo cannot take is a ``ValueError`` naming the argument."""
    P, _ = batch_shape(args, num_processes)
    steps = grpo_steps(args, P, train_size)
    check_arguments(args)
    counts = Counts(num_processes, args.num_iterations, steps, steps * args.num_iterations)
    tree: dict[str, Any] = {}
    for link in LINKS:
        for key, value in zip(link.keys, link.to(counts, *(getattr(args, name) for name in link.args))):
            if value is not OMIT:
                _set(tree, key, value)
    if model:
        tree["model"]["name_or_path"] = model
    tree["model"].update({f"lora_{k}": v for k, v in (lora or {}).items()})
    tree["data"].update(data or {})
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


def trl_values(cfg: RunConfig) -> dict[str, Any]:
    """TRL-named argument values for a grpo config (``LINKS`` read backwards); ``GRPOConfig.from_run_config``."""
    ni = cfg.loss.num_iterations
    counts = Counts(1, ni, cfg.train.max_steps, cfg.train.max_steps * ni)
    values: dict[str, Any] = {}
    for link in LINKS:
        if link.back is not None:
            values.update(link.back(counts, *(attrgetter(key)(cfg) for key in link.keys)))
    return values


def untranslated_keys(cfg: RunConfig, translated: RunConfig) -> dict[str, Any]:
    """The keys of ``cfg`` that TRL's arguments cannot say (``translated`` is what they give back), as
    ``grpo_overrides``."""
    want, got = _flat(config_to_dict(cfg)), _flat(config_to_dict(translated))
    return {key: value for key, value in want.items() if got.get(key) != value}
