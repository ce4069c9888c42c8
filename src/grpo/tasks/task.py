"""A task: a problem family the trainer trains and evaluates on without knowing anything else about it.

A ``Task`` is five things:
- ``load(source, split, limit) -> list[Example]``: its examples from a data source string (``data.train``,
  ``data.eval``); ``split`` is read by folder/hub sources, ``limit`` keeps the first N
- ``system_prompt(tag_style) -> str``: the system turn asking for its answer (used when ``data.system_prompt``
  is null)
- ``score(text, gold, tag_style) -> dict``: ``prediction`` (the answer read out of a completion's text, or
  None), ``correct`` (it matches ``gold``, the example's ``answer``), ``formatted`` (the tags are right);
  ``prediction`` is what ``maj@k`` votes on, so two predictions that ``same_answer`` counts equal are one vote
- ``same_answer(a, b) -> bool``: whether two predictions are the same answer (for the majority vote)
- ``rewards``: its default rewards, ``(name, weight)`` pairs (a recipe that lists no ``rewards`` gets these)
and optionally ``group_of(example) -> str | None``: the label evaluation reports accuracy by (K&K: the number
of people, "people=3"), and ``metrics(text, gold, tag_style) -> {name: float}``: the task's own per-completion
measures, averaged by evaluation over the greedy completions (K&K: ``per_person_accuracy``).

Built in: ``gsm8k`` (GSM8K files, folders, hub ids, ``prompts:`` files: numeric answers), ``arithmetic``
(``synthetic:`` and ``arithmetic-tools:``, grpo's generated problems) and ``kk`` (Knights and Knaves). A user's
task is a dotted path ``pkg.module:name`` naming a ``Task`` or a function that returns one (``data.task``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.data.example import Example

Score = dict[str, Any]  # {"prediction": str | None, "correct": bool, "formatted": bool}


@dataclass(frozen=True)
class Task:
    """A problem family (module docstring)."""

    name: str
    load: Callable[[str, str, int | None], list[Example]]
    system_prompt: Callable[[str], str]
    score: Callable[[str, str, str], Score]
    rewards: tuple[tuple[str, float], ...]
    same_answer: Callable[[str | None, str | None], bool] = lambda a, b: a is not None and a == b
    group_of: Callable[[Example], str | None] | None = None
    metrics: Callable[[str, str, str], dict[str, float]] | None = None

    def __post_init__(self) -> None:
        for field_name in ("load", "system_prompt", "score", "same_answer"):
            if not callable(getattr(self, field_name)):
                raise TypeError(f"task {self.name!r}: {field_name} must be callable, got "
                                f"{type(getattr(self, field_name)).__name__}")
        for field_name in ("group_of", "metrics"):
            if getattr(self, field_name) is not None and not callable(getattr(self, field_name)):
                raise TypeError(f"task {self.name!r}: {field_name} must be callable or None")
        for item in self.rewards:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], (int, float))):
                raise TypeError(f"task {self.name!r}: rewards must be (name, weight) pairs, got {item!r}")


def _builtin_tasks() -> dict[str, Task]:
    # Imported on use: the built-in tasks pull in grpo.data's loaders and grpo.rewards, which import this
    # package's neighbours (grpo.tasks.knights_knaves builds on grpo.data).
    from grpo.tasks.builtin import BUILTIN_TASKS

    return BUILTIN_TASKS


def task_names() -> list[str]:
    """The registered task names."""
    return sorted(_builtin_tasks())


def task_for_source(source: str) -> str:
    """The built-in task a data source string belongs to: ``kk`` / ``reasoning_gym`` for ``kk:`` /
    ``reasoning_gym:...``, ``arithmetic`` for
    ``synthetic:`` / ``arithmetic-tools:``, else ``gsm8k`` (files, folders, hub ids, ``prompts:``)."""
    prefix, separator, _ = source.partition(":")
    if separator and prefix in ("kk", "reasoning_gym"):
        return prefix
    if separator and prefix in ("synthetic", "arithmetic-tools"):
        return "arithmetic"
    return "gsm8k"


def resolve_task(name: str | None, source: str | None = None) -> Task:
    """The task ``data.task`` names: a registered name, a dotted path ``pkg.module:name`` to a ``Task`` or a
    function returning one, or None for the built-in task of the data ``source`` (``task_for_source``).
    Raises ValueError saying what is wrong (unknown name, a path that does not import, not a Task)."""
    tasks = _builtin_tasks()
    if name is None:
        return tasks[task_for_source(source or "")]
    if name in tasks:
        return tasks[name]
    if ":" not in name:
        raise ValueError(f"unknown task {name!r}; built in: {sorted(tasks)}, or a dotted path pkg.module:name "
                         "to a grpo.tasks.Task (or a function returning one)")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError, ValueError, TypeError) as error:  # the last two: a malformed module name
        raise ValueError(f"task {name!r}: module {module_name!r} does not import: "
                         f"{type(error).__name__}: {error}") from None
    try:
        value = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"task {name!r}: module {module_name!r} has no {attribute!r}") from None
    if not isinstance(value, Task) and callable(value):
        value = value()
    if not isinstance(value, Task):
        raise ValueError(f"task {name!r} is a {type(value).__name__}, not a grpo.tasks.Task (or a function "
                         "returning one)")
    return value


def run_task(cfg) -> Task:
    """The task of a run (``data.task``, else by ``data.train``); a bad ``data.task`` is a ConfigError naming it."""
    from grpo.config import ConfigError

    try:
        return resolve_task(cfg.data.task, cfg.data.train)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"data.task: {error}") from None


def run_system_prompt(cfg) -> str | None:
    """A run's system turn: ``data.system_prompt``, else its task's for ``data.tag_style``; None with
    ``data.add_system_prompt: false`` (no system turn from the run)."""
    if not cfg.data.add_system_prompt:
        return None
    if cfg.data.system_prompt is not None:
        return cfg.data.system_prompt
    return run_task(cfg).system_prompt(cfg.data.tag_style)
