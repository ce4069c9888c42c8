"""The ``reasoning_gym`` task: reasoning-gym's datasets, scored by their own ``score_answer``.

Data: ``data.train=reasoning_gym:NAME[,size=N,seed=S,<options>][+NAME...]`` (``grpo.data.reasoning_gym``).
The answer is the content of the completion's last ``<answer>`` tag pair (``grpo.rewards.answers``), scored
by the item's dataset (``reasoning_gym.get_score_answer_fn(metadata["source_dataset"])``, reasoning-gym's
own entry point for scoring an entry away from its dataset object) against the entry stored in the gold:

- the ``reasoning_gym`` reward (``grpo.rewards.reasoning_gym_score``) is that score, 0.0 to 1.0 (some datasets
  give partial credit), 0.0 without an answer tag; it logs the batch's mean per dataset as ``reasoning_gym/<dataset>``;
- evaluation's ``correct`` is a score of 1.0, reported per dataset (``eval/<set>/accuracy/<dataset>``)
  beside the mean score (``eval/<set>/score``).

The scorer is built from the dataset's default config: options that change how answers are read (such as
arc_agi's board format) are not seen by it.
"""

from __future__ import annotations

from grpo.data.example import Example
from grpo.data.gold_kinds import REASONING_GYM_ENTRY
from grpo.data.reasoning_gym import parse_gold
from grpo.data.sources import load_dataset_source
from grpo.data.tags import get_tag_style
from grpo.rewards.answers import extract_answer, is_well_formatted
from grpo.rewards.reasoning_gym_score import entry_score
from grpo.tasks.task import Score, Task

# The answer and the format rewards, the format one small: it only keeps the tags the answer is read from.
REWARDS = (("reasoning_gym", 1.0), ("format_think_answer", 0.1))


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


def _same_text(a: str | None, b: str | None) -> bool:
    return a is not None and a == b


REASONING_GYM_TASK = Task(name="reasoning_gym", load=load_dataset_source, system_prompt=rg_system_prompt,
                          score=rg_score, rewards=REWARDS, same_answer=_same_text, group_of=rg_dataset,
                          metrics=rg_metrics, gold=REASONING_GYM_ENTRY)
