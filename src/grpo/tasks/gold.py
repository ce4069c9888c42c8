"""Whether a run's rewards and its task's scorer can read the gold its data gives, checked before a run starts.

A data source says which gold its examples carry (``grpo.data.sources.source_gold``), a reward which gold it reads
(``grpo.rewards.registry.reward_gold``), a task which gold its ``score`` reads (``Task.gold``); kinds are
``grpo.data.gold_kinds``'. Where both sides declare a kind and the kinds differ, the reward (or the evaluation's
accuracy) could never be right, and the run would go on without a word: each such pair is a problem naming the
reward or the set, the source, and what reads that source's gold instead (the rewards of the built-in task that
reads it).
"""

from __future__ import annotations

from collections.abc import Sequence

from grpo.data.gold_kinds import NO_GOLD, describe_gold
from grpo.data.sources import load_dataset_source, source_gold
from grpo.rewards.registry import reward_gold
from grpo.tasks.builtin_tasks import BUILTIN_TASKS
from grpo.tasks.task import Task


def data_gold(task: Task, source: str) -> str | None:
    """The gold kind of ``source`` as ``task`` loads it: the source's own declaration when the task reads grpo's
    sources (``load_dataset_source``); a task with a loader of its own (a user's ``reverse:...``) gives the gold
    its scorer reads."""
    return source_gold(source) if task.load is load_dataset_source else task.gold


def reward_problems_for_gold(task: Task, rewards: Sequence[str], source: str,
                             key: str = "rewards") -> list[tuple[str, str]]:
    """``(f"{key}[i].name", why)`` for each reward of ``rewards`` (names, in order) that reads another gold than
    ``source`` gives (loaded by ``task``)."""
    given = data_gold(task, source)
    problems = []
    for i, name in enumerate(rewards):
        reads = reward_gold(name)
        if reads is not None and given is not None and reads != given:
            problems.append((f"{key}[{i}].name", (
                f"is {name}, which reads {describe_gold(reads)} as the gold answer, but the data ({source}) gives "
                f"{describe_gold(given)}: it could never score a completion right; {_instead(given)}")))
    return problems


def task_problems_for_gold(task: Task, sources: dict[str, str], key: str) -> list[tuple[str, str]]:
    """``(key or key.<set>, why)`` for each source of ``sources`` ({set name: source}; "" the unnamed set) whose
    gold the task's ``score`` (evaluation's accuracy) cannot read."""
    problems = []
    for name, source in sources.items():
        given = data_gold(task, source)
        where = f"{key}.{name}" if name else key
        if given == NO_GOLD:
            problems.append((where, (
                f"is {source}, which has {describe_gold(given)}: evaluation measures answers against a gold; "
                "evaluate on a source with answers, or set it to null")))
        elif task.gold is not None and given is not None and task.gold != given:
            problems.append((where, (
                f"is {source}, which gives {describe_gold(given)}, but the task {task.name} scores "
                f"{describe_gold(task.gold)}: its accuracy could never be right; use a source of the task's kind "
                f"or the task that reads this one ({_task_for(given)})")))
    return problems


def training_problems_for_gold(task: Task, source: str) -> list[tuple[str, str]]:
    """``("data.task", why)`` when the training data's gold is not the kind the task asks for and scores."""
    given = data_gold(task, source)
    if task.gold is None or given is None or task.gold == given or given == NO_GOLD:
        return []
    return [("data.task", (
        f"is {task.name}, which asks for and scores {describe_gold(task.gold)}, but data.train ({source}) gives "
        f"{describe_gold(given)}; set {_task_for(given)}, or data.task=null (the task of data.train)"))]


def _tasks_reading(kind: str) -> list[Task]:
    return [task for task in BUILTIN_TASKS.values() if task.gold == kind]


def _task_for(kind: str) -> str:
    names = [task.name for task in _tasks_reading(kind)]
    return " or ".join(f"data.task={name}" for name in names) or "a task of your own that reads it"


def _instead(kind: str) -> str:
    """What to use on data of ``kind``: the rewards of the built-in tasks that read it."""
    readers = sorted({name for task in _tasks_reading(kind) for name, _ in task.rewards if reward_gold(name) == kind})
    defaults = {f"{name} {weight:g}" for task in _tasks_reading(kind) for name, weight in task.rewards}
    if not readers:
        return "drop it (rewards=null: the task's defaults)"
    return (f"use {' or '.join(readers)} instead (rewards=[{readers[0]}], or rewards=null for the task's defaults: "
            f"{', '.join(sorted(defaults))})")
