"""GSM8K-style synthetic word problems with exact, non-negative integer answers.

Each problem is a chain of 1..MAX_STEPS arithmetic steps (+, -, *, / with exact division) told
as a short story (see `synthetic_templates`). The gold answer carries the worked solution, one
step per line with its equation written as "12 + 7 = 19", like GSM8K's answers, so the same data
can train a tiny model by SFT before GRPO. Generation is deterministic from the seed: one
`random.Random(seed)` drives everything, and problem i does not depend on how many follow it.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

from grpo.data.example import Example
from grpo.data.synthetic_templates import PEOPLE, PRONOUNS, THEMES, Theme


@dataclass(frozen=True)
class Difficulty:
    """How hard a problem is: the number of arithmetic steps and the digits of its numbers."""

    steps: int  # arithmetic operations in the chain
    max_digits: int  # numbers drawn from 1 .. 10**max_digits - 1 (multipliers/divisors stay small)


DIFFICULTIES: dict[str, Difficulty] = {
    "easy": Difficulty(steps=1, max_digits=1),
    "medium": Difficulty(steps=2, max_digits=2),
    "hard": Difficulty(steps=3, max_digits=3),
}
MIXED = "mixed"  # each problem draws one of DIFFICULTIES
# Named mixes: each problem draws one level of the tuple uniformly (a level listed twice is drawn
# twice as often). "mixed" lists the named levels in sorted-name order, the order it has always drawn
# from, so its problems do not change. "demo" is the embedded default model's task (see
# scripts/build_tiny_math_model.py): two-digit numbers in one- to three-step chains plus one-step
# problems with three-digit numbers, weighted towards the chains a 2.5M-parameter model can finish.
MIXES: dict[str, tuple[Difficulty, ...]] = {
    MIXED: tuple(DIFFICULTIES[name] for name in sorted(DIFFICULTIES)),
    "demo": (
        Difficulty(steps=1, max_digits=2),
        Difficulty(steps=1, max_digits=3),
        Difficulty(steps=2, max_digits=2),
        Difficulty(steps=2, max_digits=2),
        Difficulty(steps=3, max_digits=2),
    ),
}
MAX_STEPS = 5
MAX_DIGITS = 4

OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.floordiv,  # only ever applied when the division is exact
}


@dataclass(frozen=True)
class Step:
    """One arithmetic step of a solution chain: ``left op right = result``."""

    left: int
    op: str  # one of OPERATIONS
    right: int
    result: int

    @property
    def equation(self) -> str:
        """The step as written in the solution, e.g. "12 + 7 = 19"."""
        return f"{self.left} {self.op} {self.right} = {self.result}"


def generate_problems(
    n: int,
    seed: int,
    difficulty: str = MIXED,
    *,
    steps: int | None = None,
    max_digits: int | None = None,
) -> list[Example]:
    """Generate `n` word problems, deterministically from `seed`.

    difficulty: a level, "easy" (1 step, 1 digit), "medium" (2 steps, 2 digits), "hard" (3 steps,
                3 digits), or a mix of `MIXES`, whose problems each draw a level at random: "mixed"
                (easy, medium, hard) or "demo" (see `MIXES`).
    steps, max_digits: override the level's values (1..MAX_STEPS, 1..MAX_DIGITS).
    Returns Examples with one user turn, gold `answer == answer_raw == str(result)` and the
    worked solution (one line per step) in `solution`; `source` is "synthetic(seed=S):i" (1-based).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if difficulty not in MIXES and difficulty not in DIFFICULTIES:
        other_mixes = [name for name in MIXES if name != MIXED]
        raise ValueError(f"unknown difficulty {difficulty!r}; known: {[*DIFFICULTIES, MIXED]} "
                         f"and the mixes {other_mixes}")
    _check_range("steps", steps, MAX_STEPS)
    _check_range("max_digits", max_digits, MAX_DIGITS)
    rng = random.Random(seed)
    examples = []
    for index in range(n):
        level = rng.choice(MIXES[difficulty]) if difficulty in MIXES else DIFFICULTIES[difficulty]
        examples.append(
            generate_problem(
                rng,
                steps=level.steps if steps is None else steps,
                max_digits=level.max_digits if max_digits is None else max_digits,
                source=f"synthetic(seed={seed}):{index + 1}",
            )
        )
    return examples


def generate_problem(rng: random.Random, steps: int, max_digits: int, source: str) -> Example:
    """One problem of exactly `steps` steps, drawing everything from `rng`."""
    return story_problem(rng, lambda r: solution_chain(r, steps, max_digits), source)


def story_problem(rng: random.Random, make_chain: Callable[[random.Random], list[Step]], source: str) -> Example:
    """A word problem telling the chain ``make_chain(rng)`` as a story (theme and names drawn from `rng` first),
    with its worked solution; other generators (``grpo.data.arithmetic_tools``) bring their own chains."""
    theme = rng.choice(THEMES)
    fields = _story_fields(rng, theme)
    chain = make_chain(rng)
    sentences, lines = [], []
    for position, step in enumerate(chain):
        wording = (theme.start if position == 0 else theme.follow)[step.op]
        for field in theme.per_step:
            fields[field] = rng.choice(theme.vocabulary[field])
        values = {**fields, "a": step.left, "x": step.left, "b": step.right, "r": step.result}
        sentences.append(wording.question.format(**values))
        lines.append(wording.solution.format(**values))
    sentences.append(theme.ask.format(**fields))
    answer = str(chain[-1].result)
    return Example(
        messages=[{"role": "user", "content": " ".join(sentences)}],
        answer=answer,
        answer_raw=answer,
        source=source,
        solution="\n".join(lines),
    )


def solution_chain(rng: random.Random, steps: int, max_digits: int) -> list[Step]:
    """A chain of `steps` steps, each applied to the previous result, all results integers >= 1."""
    top = 10**max_digits - 1
    small = 9 if max_digits == 1 else 12  # multipliers and divisors: keeps products readable
    chain: list[Step] = []
    for position in range(steps):
        if position == 0:
            op = rng.choice(tuple(OPERATIONS))
            left, right = _first_operands(rng, op, top, small)
        else:
            left = chain[-1].result
            # Results stay >= 1, so "+" and "*" always work; "-" needs room to stay >= 1 and
            # "/" needs a small divisor of the current value.
            divisors = [d for d in range(2, small + 1) if left % d == 0]
            feasible = [op for op in OPERATIONS if (op != "-" or left >= 2) and (op != "/" or divisors)]
            op = rng.choice(feasible)
            right = _next_operand(rng, op, left, top, small, divisors)
        chain.append(Step(left=left, op=op, right=right, result=OPERATIONS[op](left, right)))
    return chain


def _first_operands(rng: random.Random, op: str, top: int, small: int) -> tuple[int, int]:
    if op == "+":
        return rng.randint(1, top), rng.randint(1, top)
    if op == "-":
        left = rng.randint(2, max(2, top))
        return left, rng.randint(1, left - 1)
    if op == "*":
        return rng.randint(1, top), rng.randint(2, small)
    divisor = rng.randint(2, small)
    # Built from the quotient, so the division is exact; a quotient of 1 would be a trivial problem.
    return divisor * rng.randint(min(2, top), top), divisor


def _next_operand(rng: random.Random, op: str, left: int, top: int, small: int, divisors: list[int]) -> int:
    if op == "+":
        return rng.randint(1, top)
    if op == "-":
        return rng.randint(1, min(left - 1, top))
    if op == "*":
        return rng.randint(2, small)
    return rng.choice(divisors)


def _story_fields(rng: random.Random, theme: Theme) -> dict[str, str]:
    name, subject = rng.choice(PEOPLE)
    friend = rng.choice([other for other, _ in PEOPLE if other != name])
    possessive, object_ = PRONOUNS[subject]
    fields = {"name": name, "friend": friend, "p": subject, "P": subject.capitalize(),
              "poss": possessive, "obj": object_}
    for field, choices in sorted(theme.vocabulary.items()):
        fields[field] = rng.choice(choices)
    return fields


def _check_range(key: str, value: int | None, maximum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum):
        raise ValueError(f"{key} must be an integer from 1 to {maximum}, got {value!r}")
