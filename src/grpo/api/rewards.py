"""``reward_funcs`` as TRL takes them: one or a list of callables (functions, closures, lambdas, bound methods,
``functools.partial``, callable objects, ``async def``), reward-model ids/paths, or loaded
``PreTrainedModel`` sequence classifiers; named as TRL names them (``rewards/<name>/mean``)."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any, Sequence

from transformers import AutoTokenizer

from grpo.config.resolve import task_provenance
from grpo.rewards import RewardFunction, reward_gold
from grpo.rewards.context import CONTEXT_KEYS
from grpo.rewards.registry import check_call_signature
from grpo.rewards.reward_model import make_model_reward, model_reward_from


def reward_name(fn: Any) -> str:
    """TRL's name for a reward: a model's (or path's) last path component; a partial's inner function's
    ``__name__``; else ``__name__``, or the class name of a callable object."""
    if isinstance(fn, (str, Path)):
        return Path(str(fn)).name or str(fn)
    config = getattr(fn, "config", None)
    if config is not None and getattr(config, "_name_or_path", None):
        return Path(config._name_or_path).name
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _processing_classes(given: Any, count: int) -> list:
    if given is None:
        return [None] * count
    classes = list(given) if isinstance(given, (list, tuple)) else [given]
    if len(classes) != count:
        raise ValueError(f"reward_processing_classes has {len(classes)} entries for {count} reward_funcs; "
                         "give one per reward (None for a function)")
    return classes


def build_reward_functions(reward_funcs: Any, reward_weights: Sequence[float] | None,
                           reward_processing_classes: Any,
                           column_names: Sequence[str] | None) -> tuple[list, list[float]]:
    """(``RewardFunction`` per reward, their weights). A reward that cannot take TRL's keyword call with the
    dataset's columns is a ValueError naming it now, before anything trains."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs or any(f is None for f in funcs):
        raise ValueError("reward_funcs: give at least one reward (a function, a reward model id/path or a model)")
    weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(funcs):
        raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} weights for {len(funcs)} reward_funcs")
    classes = _processing_classes(reward_processing_classes, len(funcs))
    keywords = list(dict.fromkeys(["prompts", "completions", "completion_ids", *(column_names or []),
                                   *CONTEXT_KEYS]))
    built, seen = [], {}
    for fn, tokenizer in zip(funcs, classes):
        name = reward_name(fn)
        if isinstance(fn, (str, Path)):
            if not Path(str(fn)).expanduser().exists() and str(fn).count("/") != 1:
                raise ValueError(f"reward_funcs: {str(fn)!r} is neither a local reward model folder nor a hub id")
            fn = make_model_reward(path=str(fn), name=name)
        elif hasattr(fn, "config") and hasattr(fn, "forward"):  # a loaded sequence-classification model
            fn = _model_reward(fn, tokenizer, name)
        elif callable(fn):
            if column_names is not None:  # None: a rollout_func's extra keys are known only when it runs
                check_call_signature(fn, name, keywords)
        else:
            raise TypeError(f"reward_funcs: {fn!r} is not a callable, a model id/path or a model")
        seen[name] = seen.get(name, 0) + 1
        built.append(RewardFunction(fn, name=name if seen[name] == 1 else f"{name}_{seen[name]}"))
    return built, weights


def _model_reward(model: Any, tokenizer: Any, name: str):
    if tokenizer is None:
        path = getattr(model.config, "_name_or_path", None)
        if not path or not Path(path).exists():
            raise ValueError(f"reward model {name!r}: give its tokenizer in reward_processing_classes (its "
                             f"name_or_path {path!r} is no local folder to load one from)")

        tokenizer = AutoTokenizer.from_pretrained(path)
    device = next(model.parameters()).device
    # A copy: scoring pads on the right, and the caller's tokenizer (often the policy's) must not change.
    return model_reward_from(model, copy.deepcopy(tokenizer), device=str(device), name=name)


def say_task_rewards(config, columns: list[str] | None) -> None:
    """The rewards a run without ``reward_funcs`` trains with (its config's: its task's unless ``grpo_overrides``
    named them), said once by the first rank; a ValueError when a dataset (``columns``: its column names; None: no
    dataset object, or not known) lacks the ``answer`` column a gold-reading reward needs: it would fail on every
    sample."""
    rewards = config.rewards or []
    reading = [r.name for r in rewards if reward_gold(r.name) is not None and "answer" not in r.columns]
    if columns is not None and reading and "answer" not in columns:
        raise ValueError(f"reward_funcs is None, so the run's rewards are its task's ({', '.join(reading)}), which "
                         f"read the gold answer from the column 'answer'; train_dataset has {sorted(columns)}: "
                         "pass reward_funcs (TRL's way) or add an answer column")
    if int(os.environ.get("RANK", "0")) == 0:
        listed = ", ".join(f"{r.name} {r.weight:g}" for r in rewards) or "none (the environment's)"
        print(f"grpo: reward_funcs is None: training with {listed} ({task_provenance(config)[0]})")
