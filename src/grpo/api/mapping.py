"""The one mapping between TRL's ``GRPOConfig`` arguments and grpo's config tree, both ways.

``to_run_config`` is what ``GRPOTrainer`` trains with and what ``GRPOConfig.to_yaml`` writes;
``trl_values`` (with ``untranslated_keys``) reads a recipe back as arguments (the keys TRL has no name for
travel in ``grpo_overrides``), so that ``GRPOConfig.from_run_config(cfg).to_run_config() == cfg``. Both read one
table, ``LINKS``:
each entry names TRL arguments, the grpo keys they set, and the conversion each way.

TRL counts optimizer updates; a grpo step is one rollout (TRL's generation) and its ``num_iterations x
mini_batches`` updates (``mini_batches``: TRL's ``steps_per_generation / gradient_accumulation_steps``), so TRL's
``max_steps``/``save_steps``/``eval_steps``/``logging_steps`` are divided by that here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable

import torch

from grpo.algorithm.advantages import ADVANTAGE_SCALES
from grpo.api.fsdp_arguments import fsdp_arguments, fsdp_keys
from grpo.config import RunConfig, config_from_dict, config_to_dict
from grpo.config.kinds import TRACKERS, VLLM_ENGINE
from grpo.config.rules import updates_per_step

if TYPE_CHECKING:
    from grpo.api.arguments import GRPOConfig

OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
             "cosine_with_min_lr": "cosine_with_min_lr"}
SCALE_REWARDS = {True: None, False: "none", "group": None, "batch": "batch", "none": "none"}


def generation_shape(B: int, GA: int, G: int, steps_per_generation: int | None, generation_batch_size: int | None,
                     processes: int) -> tuple[int, int]:
    """(prompts per step over all ranks, mini-batches per step) of TRL's batch arguments. TRL's generation is
    ``B x processes x steps_per_generation`` completions (``steps_per_generation`` given, else
    ``generation_batch_size / (B x processes)``, else GA: ``GRPOConfig.__post_init__``), G per prompt, and an
    optimizer update takes GA micro-batches of B: ``steps_per_generation / GA`` updates per pass over it, grpo's
    ``train.mini_batches``. A ValueError for a shape TRL refuses (in TRL's words) or grpo cannot run."""
    if generation_batch_size is not None:
        if generation_batch_size % (B * processes):
            raise ValueError(f"GRPOConfig: generation_batch_size ({generation_batch_size}) must be divisible by the "
                             f"global batch size ({B * processes}).")
        steps_per_generation = generation_batch_size // (B * processes)
    spg = steps_per_generation or GA
    completions = B * processes * spg
    if completions % G:
        raise ValueError(f"GRPOConfig: the generation batch ({B} x {processes} processes x {spg} steps per generation "
                         f"= {completions} completions) is not divisible by num_generations {G}")
    if spg % GA:
        raise ValueError(f"GRPOConfig.steps_per_generation={spg} is not supported with "
                         f"gradient_accumulation_steps={GA}: a grpo optimizer update takes a whole share of one "
                         "generation, so steps_per_generation must be a multiple of gradient_accumulation_steps (TRL "
                         "would accumulate an update across two generations)")
    mini_batches = spg // GA
    if mini_batches > 1 and (B * GA) % G:
        raise ValueError(f"GRPOConfig.steps_per_generation={spg} is not supported with per_device_train_batch_size={B} "
                         f"x gradient_accumulation_steps={GA} = {B * GA} completions per update and process, not whole "
                         f"groups of num_generations {G}: grpo keeps a prompt's completions in one update (TRL "
                         "shuffles the generation's rows and splits groups between updates at random); make B x GA "
                         "a multiple of num_generations")
    return completions // G, mini_batches


def batch_shape(args: GRPOConfig, num_processes: int) -> tuple[int, int, int]:
    """(prompts per step over all ranks, completions per micro-batch, mini-batches per step) of ``args``
    (``generation_shape``'s arithmetic)."""
    prompts, mini_batches = generation_shape(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                             args.num_generations, args.steps_per_generation,
                                             args.generation_batch_size, num_processes)
    return prompts, args.per_device_train_batch_size, mini_batches


def grpo_steps(args: GRPOConfig, prompts_per_step: int, train_size: int | None, mini_batches: int = 1) -> int:
    """grpo's ``train.max_steps``: TRL's ``max_steps`` / the updates per generation (num_iterations x
    ``mini_batches``), or from ``num_train_epochs`` as TRL counts them (each epoch drops the prompts that do not
    fill a last generation; its updates: generations x num_iterations x steps_per_generation / GA)."""
    ni = args.num_iterations
    per_step = ni * mini_batches
    if args.max_steps > 0:
        if args.max_steps % per_step:
            what = (f"num_iterations {ni}" if mini_batches == 1 else
                    f"the updates per generation {per_step} (num_iterations {ni} x steps_per_generation / "
                    f"gradient_accumulation_steps {mini_batches})")
            raise ValueError(f"GRPOConfig.max_steps={args.max_steps} is not a multiple of {what}: a grpo step is one "
                             "rollout and its updates")
        return args.max_steps // per_step
    if train_size is None:
        raise ValueError("GRPOConfig.max_steps=-1 counts steps from num_train_epochs and the train dataset's "
                         "length: pass train_size (GRPOTrainer does) or set max_steps")
    per_epoch = train_size // prompts_per_step
    if per_epoch == 0:
        raise ValueError(f"the train dataset has {train_size} prompts, fewer than one step's {prompts_per_step}")
    return max(1, math.ceil(math.ceil(args.num_train_epochs * per_epoch * per_step) / per_step))


def _per_step(value: float, per_step: int, max_updates: int) -> int:
    """A TRL interval in updates (a float below 1: a share of max_steps) as grpo steps, rounded up."""
    updates = math.ceil(value * max_updates) if value < 1 else int(value)
    return max(1, math.ceil(updates / per_step))


def _bf16(bf16: bool | None, init: dict | None, use_cpu: bool) -> bool:
    """``model.bf16`` of TRL's ``bf16``, ``model_init_kwargs`` and ``use_cpu``."""
    dtype = str((init or {}).get("dtype") or (init or {}).get("torch_dtype"))
    if bf16 is not None:
        return bool(bf16) or dtype.endswith("bfloat16")
    return dtype.endswith("bfloat16") or (not use_cpu and torch.cuda.is_available()
                                           and torch.cuda.is_bf16_supported())


@dataclass(frozen=True)
class Counts:
    """What converts TRL's counts to grpo's and back: ``processes`` (ranks; 1 reading a recipe back),
    ``per_step`` (updates per grpo step: num_iterations x mini-batches), ``steps`` (grpo steps) and ``updates``
    (steps x per_step)."""

    processes: int
    per_step: int
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


def _report_to(value: str | list[str]) -> list[str]:
    report_to = [value] if isinstance(value, str) else list(value)
    return [] if report_to in ([], ["none"]) else ["tensorboard"] if report_to == ["all"] else report_to


# In the config tree's order: model, data, rollout, algorithm, loss, ptx, optim, train, log.
LINKS: tuple[Link, ...] = (
    Link(("bf16", "model_init_kwargs", "use_cpu"), ("model.bf16",),
         lambda c, bf16, init, cpu: (_bf16(bf16, init, cpu),), lambda c, bf16: {"bf16": bf16}),
    same("gradient_checkpointing", "model.gradient_checkpointing"),
    Link(("trust_remote_code", "model_init_kwargs"), ("model.trust_remote_code",),
         lambda c, trust, init: (bool(trust or (init or {}).get("trust_remote_code")),),
         lambda c, trust: {"trust_remote_code": trust}),
    forward("model_init_kwargs", "model.attn_implementation", lambda init: (init or {}).get("attn_implementation")),
    same("disable_dropout", "model.disable_dropout"),
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
         lambda c, strategy, every: (strategy, _per_step(every, c.per_step, c.updates)),
         lambda c, strategy, every: {"save_strategy": strategy, "save_steps": every * c.per_step}),
    same("save_total_limit", "train.save_total_limit"),
    one("use_cpu", "train.device", lambda cpu: "cpu" if cpu else "auto", lambda device: device == "cpu"),
    Link(("eval_strategy", "eval_steps", "logging_steps"), ("train.eval_strategy", "train.eval_steps"),
         lambda c, strategy, every, logging: ("epoch" if strategy == "epoch" else "steps",
                                              _per_step(every or logging, c.per_step, c.updates)
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
         lambda c, strategy, every: (strategy, _per_step(every, c.per_step, c.updates)),
         lambda c, strategy, every: {"logging_strategy": strategy, "logging_steps": every * c.per_step}),
    one("report_to", "log.report_to", _report_to, lambda trackers: list(trackers) or "none"),
    one("disable_tqdm", "log.progress_bar", lambda disable: not disable, lambda progress: not progress),
    same("plot_at_end", "log.plots"),
)


def check_arguments(args: GRPOConfig, num_processes: int, per_step: int) -> None:
    """The values of ``args`` grpo cannot take (beyond ``batch_shape``'s and ``grpo_steps``'): a ``ValueError``
    naming the argument. ``per_step``: the optimizer updates of a grpo step (num_iterations x mini-batches)."""
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
    G = args.num_generations_eval or args.num_generations
    if args.eval_strategy != "no" and (args.per_device_eval_batch_size * num_processes) % G:
        raise ValueError(f"The global eval batch size ({args.per_device_eval_batch_size} * {num_processes}) must be "
                         f"divisible by the number of generations used for evaluation ({G}).")  # TRL's words
    if args.sync_ref_model and args.ref_model_sync_steps % per_step:
        raise ValueError(f"GRPOConfig.ref_model_sync_steps={args.ref_model_sync_steps} is not a multiple of the "
                         f"updates per generation {per_step} (num_iterations x steps_per_generation / "
                         "gradient_accumulation_steps): grpo moves the reference after a step's updates")
    if args.use_vllm and args.rollout_engine not in (None, VLLM_ENGINE):
        raise ValueError(f"GRPOConfig: use_vllm=True and rollout_engine={args.rollout_engine!r} disagree")


def to_run_config(args: GRPOConfig, *, num_processes: int = 1, train_size: int | None = None,
                  model: str | None = None, lora: dict | None = None, data: dict | None = None,
                  rewards: list[dict] | None = None, rollout: dict | None = None) -> RunConfig:
    """The checked ``RunConfig`` of ``args`` (``LINKS`` read forwards). ``model``: the policy's path or hub id;
    ``lora``: ``model.lora_*`` keys (a peft config's); ``data``: ``data.*`` keys the trainer derives from its
    datasets; ``rewards``: the ``rewards`` list; ``rollout``: ``rollout.*`` keys naming the trainer's
    tools/environment/rollout hook. A value grpo cannot take is a ``ValueError`` naming the argument."""
    P, _, mini_batches = batch_shape(args, num_processes)
    steps = grpo_steps(args, P, train_size, mini_batches)
    per_step = args.num_iterations * mini_batches
    check_arguments(args, num_processes, per_step)
    counts = Counts(num_processes, per_step, steps, steps * per_step)
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
    per_step = updates_per_step(cfg)
    counts = Counts(1, per_step, cfg.train.max_steps, cfg.train.max_steps * per_step)
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
