"""Rewards by name: a registry of factories, plus user functions by dotted path.

``get_reward_function(name, tag_style=None, **params)`` resolves ``name`` as:
- a registry key (``list_rewards()``): the factory is called with ``tag_style`` (when given) and
  ``params``; e.g. ``get_reward_function("xmlcount", tag_style="think")``,
  ``get_reward_function("model", path="ckpt/rm")``, ``get_reward_function("remote", url="http://...")``;
- ``"package.module:function"``: a user reward with TRL's signature, imported as is (so TRL reward
  functions run unchanged); ``params``, if any, are passed to it as extra keyword arguments on every
  call; ``tag_style`` is not passed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from grpo.rewards import builtin
from grpo.rewards.base import RewardCallable, RewardFactory, named
from grpo.rewards.model import make_model_reward
from grpo.rewards.remote import make_remote_reward
from grpo.tags import TagStyle

REWARD_REGISTRY: dict[str, RewardFactory] = {
    "answer_correct": builtin.make_answer_correct,
    "format_think_answer": builtin.make_format_think_answer,
    "xmlcount": builtin.make_xmlcount,
    "soft_format": builtin.make_soft_format,
    "strict_format": builtin.make_strict_format,
    "int_answer": builtin.make_int_answer,
    "correctness": builtin.make_correctness,
    "model": make_model_reward,
    "remote": make_remote_reward,
}


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(REWARD_REGISTRY)


def register_reward(name: str, factory: RewardFactory) -> None:
    """Add a factory ``factory(tag_style=..., **params) -> reward function`` under ``name``."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (reserved for 'package.module:function')")
    if name in REWARD_REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    REWARD_REGISTRY[name] = factory


def get_reward_function(name: str, /, tag_style: TagStyle | str | None = None, **params: Any) -> RewardCallable:
    """The reward function for ``name`` (see module docstring); unknown names raise ValueError listing
    the known ones. ``tag_style=None`` leaves each factory its default (``think`` for this project's
    rewards, ``reasoning`` for the Unsloth five). ``params`` that the factory does not accept raise
    ValueError listing the accepted ones."""
    if ":" in name:
        return load_dotted(name, **params)
    try:
        factory = REWARD_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; known: {list_rewards()}, or a user function as 'package.module:function'"
        ) from None
    kwargs: dict[str, Any] = {} if tag_style is None else {"tag_style": tag_style}
    kwargs.update(params)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        accepted = [p for p in inspect.signature(factory).parameters if p != "tag_style"]
        raise ValueError(f"reward {name!r}: bad parameters {sorted(params)} ({error}); accepted: {accepted}") from None
    return factory(**kwargs)


def load_dotted(path: str, /, **params: Any) -> RewardCallable:
    """Import the reward function at ``"package.module:function"`` (``function`` may be dotted, e.g.
    ``Class.method``). Errors name the path: missing module, missing attribute, not callable."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reward path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(f"reward {path!r}: no module named {missing!r} (is it on sys.path?)") from None
        raise ImportError(f"reward {path!r}: importing {module_name!r} failed: {error}") from error
    try:
        fn = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {attribute!r} is a {type(fn).__name__}, not a function")
    if not params:
        return fn
    return _bind_params(fn, params)


def _bind_params(fn: RewardCallable, params: dict[str, Any]) -> RewardCallable:
    def with_params(prompts: Any, completions: Any, **columns: Any) -> list[float | None]:
        return fn(prompts, completions, **{**columns, **params})

    if hasattr(fn, "per_sample_fallback"):
        with_params.per_sample_fallback = fn.per_sample_fallback  # type: ignore[attr-defined]
    return named(with_params, getattr(fn, "__name__", "user_reward"))
