"""The ``reasoning_gym`` task and reward: reasoning-gym's datasets, scored by their own ``score_answer``.

Data: ``data.train=reasoning_gym:NAME[,size=N,seed=S,<options>][+NAME...]`` (``grpo.data.reasoning_gym``).
The answer is the content of the completion's last ``<answer>`` tag pair (``grpo.rewards.answers``), scored
by the item's dataset (``reasoning_gym.get_score_answer_fn(metadata["source_dataset"])``, reasoning-gym's
own entry point for scoring an entry away from its dataset object) against the entry stored in the gold:

- the ``reasoning_gym`` reward is that score, 0.0 to 1.0 (some datasets give partial credit), 0.0 without
  an answer tag; it logs the batch's mean per dataset as ``reasoning_gym/<dataset>``;
- evaluation's ``correct`` is a score of 1.0, reported per dataset (``eval/<set>/accuracy/<dataset>``)
  beside the mean score (``eval/<set>/score``).

The scorer is built from the dataset's default config: options that change how answers are read (such as
arc_agi's board format) are not seen by it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from grpo.data.example import Example
from grpo.data.reasoning_gym import parse_gold, require_reasoning_gym
from grpo.data.sources import load_dataset_source
from grpo.data.tags import TagStyle, get_tag_style
from grpo.rewards.answers import extract_answer, final_text, is_well_formatted, style_of
from grpo.rewards.signature import RewardCallable
from grpo.tasks.task import Score, Task

Completion = str | list[dict[str, Any]]
# The answer and the format rewards, the format one small: it only keeps the tags the answer is read from.
REWARDS = (("reasoning_gym", 1.0), ("format_think_answer", 0.1))


@functools.lru_cache(maxsize=None)
def score_function(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    """``score_answer`` of the named reasoning-gym dataset (built once per process)."""
    require_reasoning_gym()
    from reasoning_gym.factory import get_score_answer_fn

    return get_score_answer_fn(dataset)


def entry_score(answer: str | None, entry: dict[str, Any]) -> float:
    """The entry's dataset's score of ``answer`` (None: no answer given), a float from 0.0 to 1.0."""
    return float(score_function(entry["metadata"]["source_dataset"])(answer, entry))


def rg_score(text: str, gold: str, tag_style: str) -> Score:
    """A completion's tagged answer, whether its dataset scores it 1.0, and whether its tags are right."""
    prediction = extract_answer(text, tag_style)
    return {"prediction": prediction, "correct": entry_score(prediction, parse_gold(gold)) >= 1.0,
            "formatted": is_well_formatted(text, tag_style)}


def rg_metrics(text: str, gold: str, tag_style: str) -> dict[str, float]:
    """The dataset's own score (partial credit included), averaged by evaluation as ``score``."""
    return {"score": entry_score(extract_answer(text, tag_style), parse_gold(gold))}


def rg_dataset(example: Example) -> str | None:
    """The reasoning-gym dataset an example came from (evaluation's per-dataset accuracy); None for another
    example."""
    try:
        return parse_gold(example.answer)["metadata"]["source_dataset"]
    except ValueError:
        return None


def rg_system_prompt(tag_style: str) -> str:
    style = get_tag_style(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    return (f"Respond in the following format:\n<{r}>\n...\n</{r}>\n<{a}>\n...\n</{a}>\n"
            f"Think step by step inside <{r}> tags, then give only the final answer inside <{a}> tags.")


def make_reasoning_gym(tag_style: TagStyle | str = "think") -> RewardCallable:
    """``reasoning_gym``: each completion's tagged answer scored by its item's dataset (module docstring). The
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


def _same_text(a: str | None, b: str | None) -> bool:
    return a is not None and a == b


REASONING_GYM_TASK = Task(name="reasoning_gym", load=load_dataset_source, system_prompt=rg_system_prompt,
                          score=rg_score, rewards=REWARDS, same_answer=_same_text, group_of=rg_dataset,
                          metrics=rg_metrics)
