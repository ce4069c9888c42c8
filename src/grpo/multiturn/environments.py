"""Environments (TRL's ``environment_factory``): one instance per rollout, its public methods the tools.

An environment is a class (or any factory) whose instances have ``reset(**row)`` (called with the dataset row
before the rollout; a returned string is appended to the user message), public methods the model may call as
tools (each typed and docstring'd like any tool), and optionally ``get_reward()``, an extra reward source
named after the class (weight 1), read after the rollout. A dict of factories is picked per row by its
``environment`` column. Instances are pooled: built once, ``reset`` for every rollout, as TRL does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from grpo.rewards.async_loop import is_async_callable, run_coroutine

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
        self.reward_types: list[type] = []  # classes with get_reward, one reward column each
        for name, factory in self.factories.items():
            probe = factory()
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

    def reset(self, instance: Any, row: dict) -> str | None:
        """``instance.reset(**row)`` (the ``environment`` column is a control field, not passed); its text."""
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.by_row else dict(row)
        observation = instance.reset(**kwargs)
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"{type(instance).__name__}.reset returned {type(observation).__name__}; it may return "
                             "text to append to the user message, or None")
        return observation

    def reward_functions(self) -> list[Callable]:
        """One reward function per class with ``get_reward``: the rollout's environment's reward when it is an
        instance of exactly that class, None (abstains) otherwise. Called with ``environments=`` per row."""
        functions = []
        for env_type in self.reward_types:
            def get_reward(environments, _env_type=env_type, **kwargs):
                rewards = []
                for env in environments:
                    if type(env) is not _env_type:
                        rewards.append(None)
                    elif is_async_callable(env.get_reward):
                        rewards.append(run_coroutine(env.get_reward()))
                    else:
                        rewards.append(env.get_reward())
                return rewards
            get_reward.__name__ = env_type.__name__
            functions.append(get_reward)
        return functions
