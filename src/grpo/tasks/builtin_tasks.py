"""The built-in tasks: ``gsm8k``, ``arithmetic`` (grpo's generated problems), ``kk`` (Knights and Knaves),
``reasoning_gym`` (``grpo.tasks.reasoning_gym_task``) and ``verifiers`` (a verifiers environment's taskset).

The two numeric tasks read the answer in the ``<answer>`` tags and compare it as a number
(``grpo.rewards.answers``, the helpers the rewards use, so a metric and the reward it mirrors cannot
disagree). ``kk`` reads each person's role out of the answer (``knights_knaves.text.parse_roles``).
"""

from __future__ import annotations

from grpo.data.example import Example
from grpo.data.gold_kinds import KK_SOLUTION, MATH, NO_GOLD
from grpo.data.knights_knaves.text import parse_roles, solution_roles, solution_text
from grpo.data.sources import load_dataset_source
from grpo.data.tags import get_tag_style
from grpo.rewards.answers import answers_equal, extract_answer, is_well_formatted
from grpo.rewards.knights_knaves import answer_verdict, per_person_accuracy
from grpo.tasks.reasoning_gym_task import REASONING_GYM_TASK
from grpo.tasks.task import Score, Task

# The seeds' reward: answer correct +1 / wrong -1, format ok +1.25 / bad -1.
NUMERIC_REWARDS = (("answer_correct", 1.0), ("format_think_answer", 1.0))


def numeric_score(text: str, gold: str, tag_style: str) -> Score:
    """The tagged answer of one completion, whether it equals ``gold`` as a number, and whether it is well
    formatted."""
    prediction = extract_answer(text, tag_style)
    return {"prediction": prediction, "correct": answers_equal(prediction, gold),
            "formatted": is_well_formatted(text, tag_style)}


def numeric_system_prompt(tag_style: str) -> str:
    return get_tag_style(tag_style).system_prompt


def kk_system_prompt(tag_style: str) -> str:
    """Logic-RL's instruction in the run's tags: reason first, then every person's role, one per line."""
    style = get_tag_style(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    return (f"Respond in the following format:\n<{r}>\n...\n</{r}>\n<{a}>\n...\n</{a}>\n"
            f"Reason about who is a knight and who is a knave inside <{r}> tags, then inside <{a}> tags state "
            f"every inhabitant's role, one per line in the order they were introduced, as in:\n"
            f"(1) Zoey is a knight\n(2) Oliver is a knave")


def kk_score(text: str, gold: str, tag_style: str) -> Score:
    """The roles a completion claims (as canonical solution text, so equal claims are one vote in maj@k),
    whether every role is right, and whether the tags are right."""
    names = tuple(solution_roles(gold))
    answer = extract_answer(text, tag_style)
    roles = parse_roles(answer, names) if answer is not None else None
    prediction = solution_text(names, [roles[name] for name in names]) if roles is not None else None
    return {"prediction": prediction, "correct": answer_verdict(text, gold, tag_style) == "right",
            "formatted": is_well_formatted(text, tag_style)}


def kk_people(example: Example) -> str | None:
    """"people=N" for a K&K example (its gold names N people); None when the gold is not a solution text."""
    try:
        return f"people={len(solution_roles(example.answer or ''))}"
    except ValueError:
        return None


def kk_metrics(text: str, gold: str, tag_style: str) -> dict[str, float]:
    """K&K's partial credit: the share of the people whose role the completion gets right."""
    return {"per_person_accuracy": per_person_accuracy(text, gold, tag_style)}


def no_gold_score(text: str, gold: str, tag_style: str) -> Score:
    """A verifiers taskset has no gold to score against: its environment's rubric scores the episodes (the
    config refuses it as an evaluation set, ``grpo.tasks.gold``), so this is never reached by a checked run."""
    raise ValueError("a verifiers taskset has no gold answers to evaluate against (its rubric scores episodes)")


def _same_number(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and answers_equal(a, b)


def _same_text(a: str | None, b: str | None) -> bool:
    return a is not None and a == b


BUILTIN_TASKS: dict[str, Task] = {
    "gsm8k": Task(name="gsm8k", load=load_dataset_source, system_prompt=numeric_system_prompt,
                  score=numeric_score, rewards=NUMERIC_REWARDS, same_answer=_same_number, gold=MATH),
    "arithmetic": Task(name="arithmetic", load=load_dataset_source, system_prompt=numeric_system_prompt,
                       score=numeric_score, rewards=NUMERIC_REWARDS, same_answer=_same_number, gold=MATH),
    "kk": Task(name="kk", load=load_dataset_source, system_prompt=kk_system_prompt, score=kk_score,
               rewards=(("kk_logic", 1.0),), same_answer=_same_text, group_of=kk_people,
               metrics=kk_metrics, gold=KK_SOLUTION),
    "reasoning_gym": REASONING_GYM_TASK,  # reasoning-gym's datasets, scored by their own score_answer
    # A verifiers environment brings its prompts (with their own system turn, if any) and its rubric, whose
    # rewards the run adds (grpo.multiturn.wiring): the task adds no system turn and no reward of its own.
    "verifiers": Task(name="verifiers", load=load_dataset_source, system_prompt=lambda tag_style: None,
                      score=no_gold_score, rewards=(), gold=NO_GOLD),
}
