"""The step the trainer calls: build the configured reward functions once, then score each batch.

``score`` calls every function on the batch (through ``RewardFunction``, so a failing sample abstains
instead of killing the run) and combines them with TRL's semantics:

    per_function[i, f] = reward of function f for sample i, NaN where it abstained (None)
    total[i]           = nansum_f(weight[f] * per_function[i, f])

so an abstaining function contributes nothing, and a sample where *every* function abstained gets
total 0.0 (TRL does the same and warns; the trainer can find those rows with
``per_function.isnan().all(dim=1)``). Per-function metrics are ``nanmean`` over samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.config.schema import RewardConfig
from grpo.rewards.base import RewardCallable
from grpo.rewards.guard import RewardFunction
from grpo.rewards.registry import get_reward_function
from grpo.tags import TagStyle


# A configured reward (name, weight, params) is the config tree's record; one type for one thing.
RewardSpec = RewardConfig


@dataclass
class RewardScores:
    """Rewards of one batch of N samples from F functions."""

    per_function: torch.Tensor  # [N, F] float32, NaN where the function abstained
    total: torch.Tensor  # [N] float32, nansum over functions of weight * reward
    names: list[str]  # [F] the functions' names, column order of per_function


def build_reward_functions(specs: Sequence[RewardSpec], tag_style: TagStyle | str) -> list[RewardFunction]:
    """One ``RewardFunction`` per spec, in order, built for the run's tag style (a spec's
    ``params["tag_style"]`` overrides it). Names are made unique by suffixing ``_2``, ``_3``, ...
    so that two rewards of the same kind (e.g. two remote judges) log separately.

    Any object with ``name``, ``weight`` and ``params`` attributes serves as a spec (e.g. the config's
    ``RewardConfig``)."""
    if not specs:
        raise ValueError("at least one reward is needed; known names: see grpo.rewards.list_rewards()")
    functions: list[RewardFunction] = []
    seen: dict[str, int] = {}
    for spec in specs:
        if not math.isfinite(spec.weight):
            raise ValueError(f"reward {spec.name!r} has weight {spec.weight}; weights must be finite")
        params = {"tag_style": tag_style, **spec.params}
        fn = get_reward_function(spec.name, **params)
        wrapped = RewardFunction(fn)
        seen[wrapped.name] = seen.get(wrapped.name, 0) + 1
        if seen[wrapped.name] > 1:
            wrapped = RewardFunction(fn, name=f"{wrapped.name}_{seen[wrapped.name]}")
        functions.append(wrapped)
    return functions


def score(
    reward_fns: Sequence[RewardFunction | RewardCallable],
    weights: Sequence[float],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]] | None = None,
) -> RewardScores:
    """Score N completions with F functions; see the module docstring for the combination.

    Args:
        reward_fns: [F] functions; plain callables are wrapped in ``RewardFunction`` for this call
            (pass the wrapped ones from ``build_reward_functions`` so "log once" holds across steps).
        weights: [F] coefficients.
        prompts, completions: [N] each, strings or message lists.
        columns: dataset columns, each a list of N, passed to every function as keyword lists.
    """
    columns = columns or {}
    n, num_functions = len(completions), len(reward_fns)
    if len(weights) != num_functions:
        raise ValueError(f"got {len(weights)} weights for {num_functions} reward functions")
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")

    wrapped = [fn if isinstance(fn, RewardFunction) else RewardFunction(fn) for fn in reward_fns]
    per_function = torch.full((n, num_functions), float("nan"), dtype=torch.float32)  # [N, F]
    for f, fn in enumerate(wrapped):
        rewards = fn(prompts, completions, **columns)
        per_function[:, f] = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)
    weight = torch.tensor(list(weights), dtype=torch.float32)  # [F]
    total = (per_function * weight.unsqueeze(0)).nansum(dim=1)  # [N]
    return RewardScores(per_function=per_function, total=total, names=[fn.name for fn in wrapped])
