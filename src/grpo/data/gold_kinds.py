"""What kind of gold answer an example carries, named so that a data source, a reward and a task's scorer can
say which one they give or read (``grpo.tasks.gold`` holds them against each other before a run starts).

A reward that reads one kind of gold on data of another can never score a completion right: ``answer_correct``
compares numbers, and a K&K gold is a list of statements. The kinds:

- ``math``: a number or a math expression (GSM8K's ``#### N``, grpo's generated arithmetic);
- ``kk_solution``: a Knights-and-Knaves solution, one ``(1) Zoey is a knight`` line a person;
- ``reasoning_gym_entry``: a reasoning-gym entry, ``{'answer': ..., 'metadata': ...}`` as a Python literal,
  which its dataset's own ``score_answer`` reads;
- ``none``: no gold at all (a verifiers taskset: its environment's rubric scores the episodes).

None (not a kind) means "not declared": any text, or unknown until the data is read; nothing is checked then.
"""

from __future__ import annotations

MATH = "math"
KK_SOLUTION = "kk_solution"
REASONING_GYM_ENTRY = "reasoning_gym_entry"
NO_GOLD = "none"

GOLD_KINDS: dict[str, str] = {
    MATH: "a number or math expression",
    KK_SOLUTION: "Knights-and-Knaves solutions ('(1) Zoey is a knight', a line a person)",
    REASONING_GYM_ENTRY: "reasoning-gym entries ({'answer': ..., 'metadata': ...}, scored by their dataset)",
    NO_GOLD: "no gold answer (its environment's rubric scores the episodes)",
}


def describe_gold(kind: str) -> str:
    """The words for ``kind`` in a message; ValueError for a name that is not a kind."""
    if kind not in GOLD_KINDS:
        raise ValueError(f"unknown gold kind {kind!r}; known: {sorted(GOLD_KINDS)}")
    return GOLD_KINDS[kind]
