"""``reasoning_gym``: each completion's tagged answer scored by its item's reasoning-gym dataset (the dataset's own
``score_answer``, 0.0 to 1.0, partial credit included), in TRL's reward call; the per-dataset means are logged as
``reasoning_gym/<dataset>``. The gold is a ``reasoning_gym:`` source's ``answer`` column (``grpo.data.reasoning_gym``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from grpo.data.reasoning_gym import parse_gold, require_reasoning_gym
from grpo.data.tags import TagStyle
from grpo.rewards.answers import extract_answer, final_text, style_of
from grpo.rewards.signature import RewardCallable

Completion = str | list[dict[str, Any]]


@functools.lru_cache(maxsize=None)
def score_function(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    """``score_answer`` of the named reasoning-gym dataset (built once per process)."""
    require_reasoning_gym()
    from reasoning_gym.factory import get_score_answer_fn  # optional extra (grpo[envs])

    return get_score_answer_fn(dataset)


def entry_score(answer: str | None, entry: dict[str, Any]) -> float:
    """The entry's dataset's score of ``answer`` (None: no answer given), a float from 0.0 to 1.0."""
    return float(score_function(entry["metadata"]["source_dataset"])(answer, entry))


def make_reasoning_gym(tag_style: TagStyle | str = "think") -> RewardCallable:
    """``reasoning_gym``: each completion's tagged answer scored by its item's dataset (see the module docstring). The
    gold is the dataset column ``answer`` of a ``reasoning_gym:`` source (or a reasoning-gym entry dict)."""
    style = style_of(tag_style)

    def reasoning_gym(prompts: Sequence[Any], completions: Sequence[Completion], answer: Sequence[Any] | None = None,
                      **kwargs: Any) -> list[float | None]:
        if answer is None:
            raise ValueError(f"reward 'reasoning_gym' needs the dataset column 'answer' (a reasoning_gym: data "
                             f"source's entry); got columns {sorted(kwargs)}")
        entries = [parse_gold(gold) for gold in answer]
        scores = [entry_score(extract_answer(final_text(c), style), entry)
                  for c, entry in zip(completions, entries, strict=True)]
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            by_dataset: dict[str, list[float]] = {}
            for entry, value in zip(entries, scores, strict=True):
                by_dataset.setdefault(entry["metadata"]["source_dataset"], []).append(value)
            for name, values in sorted(by_dataset.items()):
                log_metric(f"reasoning_gym/{name}", sum(values) / len(values))
        return list(scores)

    return reasoning_gym
