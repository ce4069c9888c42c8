"""A task: a problem family the trainer trains and evaluates on without knowing anything else about it.

A ``Task`` is five things:
- ``load(source, split, limit) -> list[Example]``: its examples from a data source string (``data.train``,
  ``data.eval``); ``split`` is read by folder/hub sources, ``limit`` keeps the first N
- ``system_prompt(tag_style) -> str | None``: the system turn asking for its answer (used when
  ``data.system_prompt`` is null); None: the task adds none (its examples carry their own)
- ``score(text, gold, tag_style) -> dict``: ``prediction`` (the answer read out of a completion's text, or
  None), ``correct`` (it matches ``gold``, the example's ``answer``), ``formatted`` (the tags are right);
  ``prediction`` is what ``maj@k`` votes on, so two predictions that ``same_answer`` counts equal are one vote
- ``same_answer(a, b) -> bool``: whether two predictions are the same answer (for the majority vote)
- ``rewards``: its default rewards, ``(name, weight)`` pairs (a recipe that lists no ``rewards`` gets these)
and optionally ``gold``: the gold kind its ``score`` reads (``grpo.data.gold_kinds``; None: any text), held
against the data sources before a run starts (``grpo.tasks.gold``), ``group_of(example) -> str | None``: the label evaluation reports accuracy by (K&K: the number
of people, "people=3"), and ``metrics(text, gold, tag_style) -> {name: float}``: the task's own per-completion
measures, averaged by evaluation over the greedy completions (K&K: ``per_person_accuracy``).

Built in: ``gsm8k`` (GSM8K files, folders, hub ids, ``prompts:`` files: numeric answers), ``arithmetic``
(``synthetic:`` and ``arithmetic-tools:``, grpo's generated problems) and ``kk`` (Knights and Knaves). A user's
task is a dotted path ``pkg.module:name`` naming a ``Task`` or a function that returns one (``data.task``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.data.example import Example
from grpo.data.gold_kinds import GOLD_KINDS

Score = dict[str, Any]  # {"prediction": str | None, "correct": bool, "formatted": bool}


@dataclass(frozen=True)
class Task:
    """A problem family (module docstring)."""

    name: str
    load: Callable[[str, str, int | None], list[Example]]
    system_prompt: Callable[[str], str | None]
    score: Callable[[str, str, str], Score]
    rewards: tuple[tuple[str, float], ...]
    same_answer: Callable[[str | None, str | None], bool] = lambda a, b: a is not None and a == b
    gold: str | None = None
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
        if self.gold is not None and self.gold not in GOLD_KINDS:
            raise TypeError(f"task {self.name!r}: gold must be one of {sorted(GOLD_KINDS)} or None, got {self.gold!r}")
        for item in self.rewards:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], (int, float))):
                raise TypeError(f"task {self.name!r}: rewards must be (name, weight) pairs, got {item!r}")
