"""Rewards by name: a registry of factories, plus user functions by dotted path.

``get_reward_function(name, tag_style=None, **params)`` resolves ``name`` as:
- a registry key (``list_rewards()``): the factory is called with ``tag_style`` (when given) and
  ``params``; e.g. ``get_reward_function("xmlcount", tag_style="think")``,
  ``get_reward_function("model", path="ckpt/rm")``, ``get_reward_function("remote", url="http://...")``;
- ``"package.module:function"``: a user reward with TRL's signature, imported as is (so TRL reward
  functions run unchanged); ``params``, if any, are passed to it as extra keyword arguments on every
  call; ``tag_style`` is not passed;
- ``"package.module:factory"`` with ``factory_args`` (a dict, possibly empty): a reward *factory* such as
  TRL's ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``, called once with those
  keyword arguments; what it returns is the reward function.

``check_call_signature`` finds, before a run starts, a function that cannot take TRL's keyword call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from grpo.data.gold_kinds import GOLD_KINDS, KK_SOLUTION, MATH, REASONING_GYM_ENTRY
from grpo.data.tags import TagStyle
from grpo.rewards import builtin_rewards
from grpo.rewards.async_loop import is_async_callable
from grpo.rewards.knights_knaves import make_kk_logic
from grpo.rewards.reasoning_gym_score import make_reasoning_gym
from grpo.rewards.remote import make_remote_reward
from grpo.rewards.reward_function import SIGNATURE_HINT
from grpo.rewards.reward_model import make_model_reward
from grpo.rewards.signature import RewardCallable, RewardFactory, named

REWARD_REGISTRY: dict[str, RewardFactory] = {
    "answer_correct": builtin_rewards.make_answer_correct,
    "format_think_answer": builtin_rewards.make_format_think_answer,
    "xmlcount": builtin_rewards.make_xmlcount,
    "soft_format": builtin_rewards.make_soft_format,
    "strict_format": builtin_rewards.make_strict_format,
    "int_answer": builtin_rewards.make_int_answer,
    "correctness": builtin_rewards.make_correctness,
    "kk_logic": make_kk_logic,
    "reasoning_gym": make_reasoning_gym,
    "model": make_model_reward,
    "remote": make_remote_reward,
}

# The gold each registered reward reads (grpo.data.gold_kinds), held against the data before a run starts
# (grpo.tasks.gold). A reward not listed reads none (the format rewards, a reward model, a remote judge) or any
# text (``correctness``: exact string equality).
READS_GOLD: dict[str, str] = {
    "answer_correct": MATH,
    "kk_logic": KK_SOLUTION,
    "reasoning_gym": REASONING_GYM_ENTRY,
}


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(REWARD_REGISTRY)


def register_reward(name: str, factory: RewardFactory, *, reads_gold: str | None = None) -> None:
    """Add a factory ``factory(tag_style=..., **params) -> reward function`` under ``name``; ``reads_gold``: the
    gold kind its functions compare against (``grpo.data.gold_kinds``), so that data of another kind is refused
    before a run starts; None: none, or any text."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (reserved for 'package.module:function')")
    if name in REWARD_REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    if reads_gold is not None and reads_gold not in GOLD_KINDS:
        raise ValueError(f"reward {name!r}: reads_gold {reads_gold!r} is not a gold kind; known: {sorted(GOLD_KINDS)}")
    REWARD_REGISTRY[name] = factory
    if reads_gold is not None:
        READS_GOLD[name] = reads_gold


def reward_gold(name: str) -> str | None:
    """The gold kind reward ``name`` reads (``READS_GOLD``); None for one that reads none or any text, and for a
    dotted path (a user's function, not imported to ask)."""
    return READS_GOLD.get(name)


def get_reward_function(name: str, /, tag_style: TagStyle | str | None = None,
                        factory_args: dict[str, Any] | None = None, **params: Any) -> RewardCallable:
    """The reward function for ``name`` (see module docstring); unknown names raise ValueError listing
    the known ones. ``tag_style=None`` leaves each factory its default (``think`` for this project's
    rewards, ``reasoning`` for the Unsloth five). ``params`` that the factory does not accept raise
    ValueError listing the accepted ones. ``factory_args`` (dotted paths only) marks ``name`` as a
    factory to call with them."""
    if ":" in name:
        fn = build_from_factory(name, factory_args) if factory_args is not None else load_dotted(name)
        return _bind_params(fn, params) if params else fn
    if factory_args is not None:
        raise ValueError(f"reward {name!r}: factory_args is for a user factory given as 'package.module:factory'; "
                         f"a built-in reward takes its settings in params")
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


def build_from_factory(path: str, factory_args: dict[str, Any]) -> RewardCallable:
    """Call the factory at ``path`` with ``factory_args`` once; its result must be callable."""
    factory = load_dotted(path)
    try:
        inspect.signature(factory).bind(**factory_args)
    except TypeError as error:
        accepted = list(inspect.signature(factory).parameters)
        raise ValueError(f"reward factory {path!r}: bad factory_args {sorted(factory_args)} ({error}); "
                         f"accepted: {accepted}") from None
    except ValueError:  # no signature to read (a builtin): let the call say what is wrong
        pass
    try:
        fn = factory(**factory_args)
    except Exception as error:
        raise ValueError(f"reward factory {path!r} raised {type(error).__name__}: {error}") from error
    if not callable(fn):
        raise ValueError(f"reward factory {path!r} returned a {type(fn).__name__}, not a reward function")
    return fn


def check_call_signature(fn: Any, name: str, keywords: list[str]) -> None:
    """Raise ValueError if ``fn`` cannot be called with exactly ``keywords`` as keyword arguments (TRL's
    call, see ``reward_function.py``): a required parameter it would not get, or a keyword it would refuse. A
    callable whose signature cannot be read is left to the call itself."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as error:
        raise ValueError(f"reward {name!r} cannot be called with the keywords {keywords}: {error} "
                         f"({SIGNATURE_HINT})") from None


def _bind_params(fn: RewardCallable, params: dict[str, Any]) -> RewardCallable:
    if is_async_callable(fn):
        async def with_params(**keywords: Any) -> list[float | None]:  # type: ignore[misc]
            return await fn(**{**keywords, **params})
    else:
        def with_params(**keywords: Any) -> list[float | None]:  # type: ignore[misc]
            return fn(**{**keywords, **params})

    with_params.__wrapped__ = fn  # type: ignore[attr-defined]  # inspect.signature reads fn's (check_call_signature)
    if hasattr(fn, "per_sample_fallback"):
        with_params.per_sample_fallback = fn.per_sample_fallback  # type: ignore[attr-defined]
    return named(with_params, getattr(fn, "__name__", "user_reward"))
