"""TRL's ``GRPOConfig`` arguments to grpo's config tree and back, by the one table of ``grpo.api.trl_fields``.

``to_run_config`` is what ``GRPOTrainer`` trains with and what ``GRPOConfig.to_yaml`` writes;
``trl_values`` (with ``untranslated_keys``) reads a recipe back as arguments (the keys TRL has no name for
travel in ``grpo_overrides``), so that ``GRPOConfig.from_run_config(cfg).to_run_config() == cfg``.

TRL counts optimizer updates; a grpo step is one rollout (TRL's generation) and its ``num_iterations x
mini_batches`` updates (``mini_batches``: TRL's ``steps_per_generation / gradient_accumulation_steps``), so TRL's
``max_steps``/``save_steps``/``eval_steps``/``logging_steps`` are divided by that (``grpo.api.trl_batch``).
``args`` is a ``grpo.api.GRPOConfig``, read by its fields' names.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from grpo.algorithm.advantages import ADVANTAGE_SCALES
from grpo.api.trl_batch import Counts, batch_shape, grpo_steps
from grpo.api.trl_fields import LINKS, OMIT, OPTIMIZERS, SCALE_REWARDS, SCHEDULES, report_trackers
from grpo.config import RunConfig, config_from_dict, config_to_dict
from grpo.config.kinds import TRACKERS, VLLM_ENGINE
from grpo.config.rules import updates_per_step


def check_arguments(args: Any, num_processes: int, per_step: int) -> None:
    """The values of ``args`` grpo cannot take (beyond ``batch_shape``'s and ``grpo_steps``'): a ``ValueError``
    naming the argument. ``per_step``: the optimizer updates of a grpo step (num_iterations x mini-batches)."""
    if args.lr_scheduler_type not in SCHEDULES:
        raise ValueError(f"GRPOConfig.lr_scheduler_type={args.lr_scheduler_type!r} is not supported: grpo has "
                         f"{sorted(SCHEDULES)}")
    if args.optim not in OPTIMIZERS:
        raise ValueError(f"GRPOConfig.optim={args.optim!r} is not supported: grpo has {sorted(OPTIMIZERS)}")
    if set(report_trackers(args.report_to)) - set(TRACKERS):
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


def to_run_config(args: Any, *, num_processes: int = 1, train_size: int | None = None,
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
