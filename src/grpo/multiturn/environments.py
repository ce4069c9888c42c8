"""Environments (TRL's ``environment_factory``): one instance per rollout, its public methods the tools.

An environment is a class (or any factory) whose instances have ``reset(**row)`` (called with the dataset row
before the rollout; a returned string is appended to the user message), public methods the model may call as
tools (each typed and docstring'd like any tool), and optionally ``get_reward()``, an extra reward source
named after the class (weight 1), read after the rollout. A dict of factories is picked per row by its
``environment`` column. Instances are pooled: built once, ``reset`` for every rollout, as TRL does.

An environment is often a client of a server (OpenEnv's): a ``reset`` or ``get_reward`` that raises does not end
the run. A failed reset gives the rollout the error as its observation (as a failed tool call gives the model its
error), a failed get_reward is a zero reward; each is logged with the run's count so far.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any, Callable

from grpo.multiturn.tools import install_hint
from grpo.rewards.async_loop import is_async_callable, run_coroutine

logger = logging.getLogger(__name__)
RESERVED = ("reset", "get_reward")


def environment_methods(instance: Any) -> list[Callable]:
    """The instance's tools: the public functions of its class other than reset and get_reward (listed on the
    class, so properties are not evaluated), bound to the instance."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


class Environments:
    """``{name: factory}`` (a single factory is the name None) and a pool of instances per name."""

    def __init__(self, factories: Callable | dict[str, Callable]):
        self.by_row = isinstance(factories, dict)  # pick the factory by the row's `environment` column
        self.factories = dict(factories) if self.by_row else {None: factories}
        if not self.factories:
            raise ValueError("environment_factory is an empty dict")
        self.pool: dict[Any, list] = {}
        self.failures = {"reset": 0, "get_reward": 0}  # the run's count of each, for the warnings
        self.reward_types: list[type] = []  # classes with get_reward, one reward column each
        for name, factory in self.factories.items():
            try:
                probe = factory()
            except ImportError as exc:  # a client built lazily, its package missing: name the extra if it is one
                if not install_hint(exc):
                    raise
                raise ImportError(f"environment {name!r}: {exc}{install_hint(exc)}", name=exc.name) from exc
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment {name!r}: {type(probe).__name__} has no callable reset(**row)")
            self.pool[name] = [probe]
            if callable(getattr(probe, "get_reward", None)) and type(probe) not in self.reward_types:
                self.reward_types.append(type(probe))

    def name_of(self, row: dict) -> Any:
        if not self.by_row:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"a row has environment={name!r}, which is not among the environments given "
                             f"({sorted(map(str, self.factories))}); every row needs an 'environment' column naming one")
        return name

    def instances(self, rows: list[dict]) -> list[Any]:
        """One instance per row (pooled: more are built only when a batch needs more of one kind at once)."""
        handed: dict[Any, int] = {}
        out = []
        for row in rows:
            name = self.name_of(row)
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            out.append(pool[index])
        return out

    def reset(self, instance: Any, row: dict) -> tuple[str | None, bool]:
        """``instance.reset(**row)`` (the ``environment`` column is a control field, not passed): its text, and
        whether it raised (then the text is the error, as ``{"error": ...}`` on a line of its own)."""
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.by_row else dict(row)
        try:
            observation = instance.reset(**kwargs)
        except Exception as exc:  # a server down or refusing: this rollout sees the error, the run goes on
            error = self._failed("reset", instance, exc, "the rollout starts with the error as its observation")
            return "\n" + json.dumps({"error": error}), True
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"{type(instance).__name__}.reset returned {type(observation).__name__}; it may return "
                             "text to append to the user message, or None")
        return observation, False

    def _failed(self, method: str, instance: Any, exc: Exception, outcome: str) -> str:
        self.failures[method] += 1
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("%s.%s raised %s; %s (%d %s failures so far)", type(instance).__name__, method, error, outcome,
                       self.failures[method], method)
        return error

    def reward_of(self, env: Any) -> float | None:
        """``env.get_reward()`` (awaited when async); 0.0 with a counted warning when it raises."""
        try:
            return run_coroutine(env.get_reward()) if is_async_callable(env.get_reward) else env.get_reward()
        except Exception as exc:  # as a failed reset: the run goes on, this rollout scores zero
            self._failed("get_reward", env, exc, "its reward is 0")
            return 0.0

    def reward_functions(self) -> list[Callable]:
        """One reward function per class with ``get_reward``: the rollout's environment's reward when it is an
        instance of exactly that class, None (abstains) otherwise. Called with ``environments=`` per row."""
        functions = []
        for env_type in self.reward_types:
            def get_reward(environments, _env_type=env_type, **kwargs):
                return [self.reward_of(env) if type(env) is _env_type else None for env in environments]
            get_reward.__name__ = env_type.__name__
            functions.append(get_reward)
        return functions
