"""The Logic-RL rule reward for K&K (``kk_logic``): a format score plus an answer score.

    format   +1   the completion is ``<think>...</think><answer>...</answer>`` (``is_well_formatted``)
             -1   otherwise
    answer   +2   every person's role in the ``<answer>`` is right
             -1.5 every person has one role there, and some are wrong
             -2   no ``<answer>`` tag, or some person has no role or two (``text.parse_roles`` is None)

The total (-3 to +3) is one reward; the gold is the dataset column ``answer``, the canonical solution
text "(1) Zoey is a knight\\n(2) Oliver is a knave" (``text.solution_text``), which also names the people.
Unlike Logic-RL's scorer, the answer is judged even when the format is not, so the two parts stay
independent signals (a right answer out of format scores -1 + 2 = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.data.knights_knaves.text import parse_roles, role_claims, solution_roles
from grpo.data.tags import TagStyle
from grpo.rewards.answers import extract_answer, final_text, is_well_formatted, style_of
from grpo.rewards.signature import RewardCallable

FORMAT_SCORES = {"well_formatted": 1.0, "not": -1.0}
ANSWER_SCORES = {"right": 2.0, "wrong": -1.5, "unparseable": -2.0}

Completion = str | list[dict[str, Any]]


def answer_verdict(text: str, gold: str, tag_style: TagStyle | str = "think") -> str:
    """"right", "wrong" or "unparseable" (keys of ``ANSWER_SCORES``) for a completion's text."""
    expected = solution_roles(gold)
    answer = extract_answer(text, tag_style)
    claimed = parse_roles(answer, tuple(expected)) if answer is not None else None
    if claimed is None:
        return "unparseable"
    return "right" if claimed == expected else "wrong"


def kk_logic_score(text: str, gold: str, tag_style: TagStyle | str = "think") -> tuple[float, float]:
    """``(format score, answer score)`` of one completion's text (see the module docstring)."""
    formatted = is_well_formatted(text, tag_style)
    return FORMAT_SCORES["well_formatted" if formatted else "not"], ANSWER_SCORES[answer_verdict(text, gold, tag_style)]


def per_person_accuracy(completion: Completion, gold: str, tag_style: TagStyle | str = "think") -> float:
    """The share of the gold's people whose role the completion's ``<answer>`` gets right (0.0 without an
    answer; a person with no role or with both roles counts as wrong). For metrics, not the reward."""
    expected = solution_roles(gold)
    answer = extract_answer(final_text(completion), tag_style)
    if answer is None:
        return 0.0
    claims = role_claims(answer, tuple(expected))
    return sum(claims[name] == {knight} for name, knight in expected.items()) / len(expected)


def make_kk_logic(tag_style: TagStyle | str = "think") -> RewardCallable:
    """``kk_logic``: format score + answer score per completion (module docstring). Logs the batch's mean
    per-person accuracy as ``kk_logic/per_person_accuracy`` when called with ``log_metric``."""
    style = style_of(tag_style)

    def kk_logic(
        prompts: Sequence[Any],
        completions: Sequence[Completion],
        answer: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        if answer is None:
            raise ValueError(f"reward 'kk_logic' needs the dataset column 'answer' (the K&K solution text); "
                             f"got columns {sorted(kwargs)}")
        texts = [final_text(c) for c in completions]
        scores: list[float | None] = [sum(kk_logic_score(t, str(g), style)) for t, g in zip(texts, answer, strict=True)]
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and texts:
            accuracies = [per_person_accuracy(t, str(g), style) for t, g in zip(texts, answer, strict=True)]
            log_metric("kk_logic/per_person_accuracy", sum(accuracies) / len(accuracies))
        return scores

    return kk_logic
