"""One-step word problems with large or small numbers: the task of the calculator demo.

A *large* problem's numbers are too long for the tiny model to work out in its head (sums and differences
of 4-6 digit numbers, 3-4 digit times 2-digit products, exact divisions by a 2-digit number with a 3-4 digit
quotient); a *small* one is the tiny-math model's own one-step arithmetic (numbers below 100, multipliers
and divisors up to 12), which it gets right without help. With a calculator tool both are easy, so GRPO can
teach the model to call it where its own arithmetic fails (``configs/tools-demo-cpu.yaml``).

The stories are the synthetic generator's (``grpo.data.synthetic.story_problem``): the same themes, the
same worked solution ("4821 * 37 = 178377"), gold answers non-negative integers that ``answer_correct``
checks. Deterministic from the seed; problem i does not depend on how many follow it.
"""

from __future__ import annotations

import random

from grpo.data.example import Example
from grpo.data.synthetic import OPERATIONS, Step, solution_chain, story_problem

SIZES = ("large", "small", "mix")  # mix: each problem is large or small with probability 1/2


def generate_tool_problems(n: int, seed: int, size: str = "mix") -> list[Example]:
    """``n`` one-step word problems of the given ``size`` (``SIZES``); ``source`` is
    "arithmetic-tools(seed=S,size=Z):i" (1-based) and ``solution`` the one-line worked solution."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {list(SIZES)}")
    rng = random.Random(seed)
    examples = []
    for index in range(n):
        large = rng.random() < 0.5 if size == "mix" else size == "large"
        make_chain = large_step if large else small_step
        examples.append(story_problem(rng, make_chain, f"arithmetic-tools(seed={seed},size={size}):{index + 1}"))
    return examples


def is_large(example: Example) -> bool:
    """Whether a problem of this module has large numbers, read from its worked solution: large sums and
    differences have a 4+ digit right operand, large products and quotients a multiplier or divisor above
    12; small problems have neither (their right operand is below 100, and at most 12 for * and /)."""
    _left, op, right = example.solution.split(" = ")[0].split()[-3:]
    return int(right) >= 1000 or (op in "*/" and int(right) > 12)


def large_step(rng: random.Random) -> list[Step]:
    """One step with numbers the tiny model cannot handle alone."""
    op = rng.choice(tuple(OPERATIONS))
    if op == "+":
        left, right = _digits(rng, 4, 6), _digits(rng, 4, 6)
    elif op == "-":
        left = _digits(rng, 5, 6)
        right = rng.randint(1000, left - 1)
    elif op == "*":
        left, right = _digits(rng, 3, 4), rng.randint(13, 99)
    else:
        right = rng.randint(13, 99)
        left = right * _digits(rng, 3, 4)
    return [Step(left=left, op=op, right=right, result=OPERATIONS[op](left, right))]


def small_step(rng: random.Random) -> list[Step]:
    """One step as the tiny-math model learnt them: two-digit numbers, multipliers and divisors up to 12."""
    return solution_chain(rng, 1, 2)


def _digits(rng: random.Random, low: int, high: int) -> int:
    """A number with ``low``..``high`` digits, the digit count drawn first (so short ones are as common)."""
    digits = rng.randint(low, high)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)
