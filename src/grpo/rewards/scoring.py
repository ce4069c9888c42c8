"""The step the trainer calls: build the configured reward functions once, then score each batch.

``score`` calls every function on the batch the way TRL 1.16 does (by keyword, with ``completion_ids``,
the dataset columns, ``trainer_state``, ``log_extra`` and ``log_metric``; async functions awaited
together), through ``RewardFunction`` so a failing sample abstains instead of killing the run, and
combines them with TRL's semantics:

    per_function[i, f] = reward of function f for sample i, NaN where it abstained (None)
    total[i]           = nansum_f(weight[f] * per_function[i, f])

so an abstaining function contributes nothing, and a sample where *every* function abstained gets
total 0.0 (TRL does the same and warns; the trainer can find those rows with
``per_function.isnan().all(dim=1)``). Per-function metrics are ``nanmean`` over samples.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.data.tags import TagStyle
from grpo.rewards.async_loop import run_coroutine
from grpo.rewards.context import CONTEXT_KEYS, RewardContext
from grpo.rewards.registry import check_call_signature, get_reward_function
from grpo.rewards.reward_function import RewardFunction
from grpo.rewards.signature import RewardCallable


@dataclass
class RewardSpec:
    """A configured reward: a name (built-in, ``model``, ``remote`` or ``pkg.module:function``), its weight and
    keyword arguments. The config tree's ``RewardConfig`` is this record with each field's documentation."""

    name: str
    weight: float = 1.0
    params: dict = field(default_factory=dict)
    factory_args: dict | None = None
    columns: dict = field(default_factory=dict)


@dataclass
class RewardScores:
    """Rewards of one batch of N samples from F functions."""

    per_function: torch.Tensor  # [N, F] float32, NaN where the function abstained
    total: torch.Tensor  # [N] float32, nansum over functions of weight * reward
    names: list[str]  # [F] the functions' names, column order of per_function


def build_reward_functions(specs: Sequence[RewardSpec], tag_style: TagStyle | str,
                           column_names: Sequence[str] | None = None) -> list[RewardFunction]:
    """One ``RewardFunction`` per spec, in order, built for the run's tag style (a spec's
    ``params["tag_style"]`` overrides it). Names are made unique by suffixing ``_2``, ``_3``, ...
    so that two rewards of the same kind (e.g. two remote judges) log separately.

    ``column_names`` (the dataset's columns, when known) lets every function's signature and column
    mapping be checked against TRL's keyword call now, before a run spends anything: ValueError
    naming the reward.

    Any object with ``name``, ``weight`` and ``params`` attributes serves as a spec (e.g. the config's
    ``RewardConfig``); ``factory_args`` and ``columns`` are optional."""
    if not specs:
        raise ValueError("at least one reward is needed; known names: see grpo.rewards.list_rewards()")
    functions: list[RewardFunction] = []
    seen: dict[str, int] = {}
    for spec in specs:
        if not math.isfinite(spec.weight):
            raise ValueError(f"reward {spec.name!r} has weight {spec.weight}; weights must be finite")
        params = {"tag_style": tag_style, **spec.params}
        column_map = dict(getattr(spec, "columns", None) or {})
        fn = get_reward_function(spec.name, factory_args=getattr(spec, "factory_args", None), **params)
        if column_names is not None:
            missing = sorted(set(column_map.values()) - set(column_names))
            if missing:
                raise ValueError(f"reward {spec.name!r}: columns reads the dataset columns {missing}, which the "
                                 f"data does not have; its columns: {sorted(column_names)}")
            keywords = ["prompts", "completions", "completion_ids", *column_names, *column_map, *CONTEXT_KEYS]
            check_call_signature(fn, spec.name, list(dict.fromkeys(keywords)))
        wrapped = RewardFunction(fn, column_map=column_map)
        seen[wrapped.name] = seen.get(wrapped.name, 0) + 1
        if seen[wrapped.name] > 1:
            wrapped = RewardFunction(fn, name=f"{wrapped.name}_{seen[wrapped.name]}", column_map=column_map)
        functions.append(wrapped)
    return functions


def score(
    reward_fns: Sequence[RewardFunction | RewardCallable],
    weights: Sequence[float],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]] | None = None,
    completion_ids: Sequence[list[int]] | None = None,
    context: RewardContext | None = None,
) -> RewardScores:
    """Score N completions with F functions; see the module docstring for the combination.

    Args:
        reward_fns: [F] functions; plain callables are wrapped in ``RewardFunction`` for this call
            (pass the wrapped ones from ``build_reward_functions`` so "log once" holds across steps).
        weights: [F] coefficients.
        prompts, completions: [N] each, strings or message lists.
        columns: dataset columns, each a list of N, passed to every function as keyword lists.
        completion_ids: [N] token-id lists (each completion's tokens up to and including EOS).
        context: ``trainer_state`` and the logging hooks (``context.py``); what the functions log
            collects in it. None: a fresh one (global_step 0).
    """
    columns = columns or {}
    context = context if context is not None else RewardContext()
    n, num_functions = len(completions), len(reward_fns)
    if len(weights) != num_functions:
        raise ValueError(f"got {len(weights)} weights for {num_functions} reward functions")
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")

    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"got {len(completion_ids)} completion_ids for {n} completions")

    wrapped = [fn if isinstance(fn, RewardFunction) else RewardFunction(fn) for fn in reward_fns]
    results: dict[int, list[float | None]] = {}
    for f, fn in enumerate(wrapped):  # synchronous functions in order, as TRL
        if not fn.is_async:
            results[f] = fn(prompts, completions, completion_ids, context, **columns)
    async_indices = [f for f, fn in enumerate(wrapped) if fn.is_async]
    if async_indices:  # awaited together, as TRL's asyncio.gather

        async def gather() -> list[list[float | None]]:
            return await asyncio.gather(*(wrapped[f].acall(prompts, completions, completion_ids, context, **columns)
                                          for f in async_indices))

        results.update(zip(async_indices, run_coroutine(gather())))
    per_function = torch.full((n, num_functions), float("nan"), dtype=torch.float32)  # [N, F]
    for f, rewards in results.items():
        per_function[:, f] = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)
    weight = torch.tensor(list(weights), dtype=torch.float32)  # [F]
    total = (per_function * weight.unsqueeze(0)).nansum(dim=1)  # [N]
    return RewardScores(per_function=per_function, total=total, names=[fn.name for fn in wrapped])
