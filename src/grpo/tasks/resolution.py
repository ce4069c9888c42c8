"""Which task a run trains on: a built-in name, a dotted path ``pkg.module:name`` to a ``Task`` (or a function
returning one), or, with no name, the built-in task of the data source."""

from __future__ import annotations

import importlib

from grpo.errors import ConfigError
from grpo.tasks.builtin_tasks import BUILTIN_TASKS
from grpo.tasks.task import Task


def task_names() -> list[str]:
    """The registered task names."""
    return sorted(BUILTIN_TASKS)


def task_for_source(source: str) -> str:
    """The built-in task a data source string belongs to: ``kk`` / ``reasoning_gym`` / ``verifiers`` for ``kk:`` /
    ``reasoning_gym:...`` / ``verifiers:...``, ``arithmetic`` for ``synthetic:`` / ``arithmetic-tools:``, else
    ``gsm8k`` (files, folders, hub ids, ``prompts:``, a Python dataset object)."""
    prefix, separator, _ = source.partition(":")
    if separator and prefix in ("kk", "reasoning_gym", "verifiers"):
        return prefix
    if separator and prefix in ("synthetic", "arithmetic-tools"):
        return "arithmetic"
    return "gsm8k"


def resolve_task(name: str | None, source: str | None = None) -> Task:
    """The task ``data.task`` names: a registered name, a dotted path ``pkg.module:name`` to a ``Task`` or a
    function returning one, or None for the built-in task of the data ``source`` (``task_for_source``).
    Raises ValueError saying what is wrong (unknown name, a path that does not import, not a Task)."""
    tasks = BUILTIN_TASKS
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
    try:
        return resolve_task(cfg.data.task, cfg.data.train)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"data.task: {error}") from None


def run_system_prompt(cfg, task: Task | None = None) -> str | None:
    """A run's system turn: ``data.system_prompt``, else its task's for ``data.tag_style`` (``task``: the run's,
    resolved already; None: resolved here); None with ``data.add_system_prompt: false`` or a task that adds none
    (no system turn)."""
    if not cfg.data.add_system_prompt:
        return None
    if cfg.data.system_prompt is not None:
        return cfg.data.system_prompt
    return (task if task is not None else run_task(cfg)).system_prompt(cfg.data.tag_style)
