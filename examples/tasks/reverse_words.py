"""A task of your own for grpo: reverse the order of a few words ("apple river stone" -> "stone river apple").

A task is its data (from a source string), the system prompt asking for its answer, a scorer that reads the
answer out of a completion and checks it, and its default rewards. This file is all of it; with the folder
on PYTHONPATH a recipe names it as ``data.task: reverse_words:task``:

    PYTHONPATH=examples/tasks grpo train configs/smoke-cpu.yaml data.task=reverse_words:task \\
        data.train=reverse:seed=1,n=256 data.eval=reverse:seed=2,n=32 rewards=null
    PYTHONPATH=examples/tasks grpo eval runs/smoke              # scored by score() below, grouped by words=N

(``rewards=null`` drops the smoke recipe's own rewards, so the run trains with this task's.)
"""

from __future__ import annotations

import random
import re

from grpo.data import DataError, Example
from grpo.data.tags import get_tag_style
from grpo.rewards import extract_answer, is_well_formatted
from grpo.tasks import Task

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "rocket", "violet",
         "marble", "harbor", "pepper", "saddle", "winter")
SOURCE_FORM = "reverse:seed=S,n=N[,words=LO-HI]"


def load(source: str, split: str, limit: int | None) -> list[Example]:
    """``reverse:seed=S,n=N[,words=LO-HI]``: N problems of LO to HI distinct words (3-5 unless given), the
    same for the same seed (give the held-out set another seed). ``split`` is for sources that have splits
    (a hub dataset); generated problems have none. ``limit``: only the first N (the same first N)."""
    kind, _, settings_text = source.partition(":")
    if kind != "reverse":
        raise DataError(f"{source!r}: the reverse_words task reads {SOURCE_FORM}")
    try:
        settings = dict(item.split("=", 1) for item in settings_text.split(",") if item)
        seed, count = int(settings.pop("seed")), int(settings.pop("n"))
        low, _, high = settings.pop("words", "3-5").partition("-")
        low, high = int(low), int(high or low)
    except (KeyError, ValueError) as error:  # a missing key, a value that is no number, an item without "="
        raise DataError(f"{source!r}: expected {SOURCE_FORM} ({type(error).__name__}: {error})") from None
    if settings or not 2 <= low <= high <= len(WORDS):
        raise DataError(f"{source!r}: unknown settings {sorted(settings)} or words out of 2-{len(WORDS)}; "
                        f"expected {SOURCE_FORM}")
    rng = random.Random(seed)
    examples = []
    for index in range(count if limit is None else min(count, limit)):
        words = rng.sample(WORDS, rng.randint(low, high))
        gold = " ".join(reversed(words))
        examples.append(Example(messages=[{"role": "user", "content": "Reverse the order of these words: "
                                                                      + " ".join(words)}],
                                answer=gold, answer_raw=gold, source=f"{source}#{index}"))
    return examples


def system_prompt(tag_style: str) -> str:
    """The system turn (``data.system_prompt: null``): the answer format in the run's tags (``data.tag_style``)."""
    style = get_tag_style(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    return (f"Respond in the following format:\n<{r}>\n...\n</{r}>\n<{a}>\n...\n</{a}>\n"
            f"Think inside <{r}> tags, then give only the words in reverse order inside <{a}> tags.")


def words_of(text: str | None) -> str | None:
    """An answer's words, lower case, single-spaced (so "Stone, River, apple" is "stone river apple");
    None when there is no answer or no word in it."""
    words = re.findall(r"[a-z]+", (text or "").lower())
    return " ".join(words) or None


def score(text: str, gold: str, tag_style: str) -> dict:
    """What evaluation reports: the prediction (what maj@k votes on), whether it is right, whether the tags are."""
    prediction = words_of(extract_answer(text, tag_style))
    return {"prediction": prediction, "correct": prediction is not None and prediction == words_of(gold),
            "formatted": is_well_formatted(text, tag_style)}


def reversed_words(completions, answer, **kwargs) -> list[float]:
    """The training reward (called as TRL calls rewards; ``answer`` is the gold column): 1 for the words in
    reverse order, else half the share of positions right, so a near miss beats no answer (0)."""
    rewards = []
    for completion, gold in zip(completions, answer):
        said = (words_of(extract_answer(completion[0]["content"])) or "").split()
        want = gold.split()
        right = sum(a == b for a, b in zip(said, want))
        rewards.append(1.0 if said == want else 0.5 * right / len(want))
    return rewards


def word_count(example: Example) -> str:
    """The label evaluation reports accuracy by."""
    return f"words={len(example.answer.split())}"


task = Task(
    name="reverse_words",
    load=load,
    system_prompt=system_prompt,
    score=score,
    # A reward by dotted path, named through this module's own import name, and a built-in one.
    rewards=((f"{__name__}:reversed_words", 1.0), ("format_think_answer", 0.5)),
    group_of=word_count,
)
