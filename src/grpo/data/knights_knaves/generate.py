"""Generated K&K puzzles with exactly one solution, drawn as the benchmark draws them.

Each person's statement is one of six forms, equally likely (the benchmark's sampler at depth 2,
width 2): a claim "X is a knight/knave", its negation, or two distinct claims joined by and, or,
if-then or if-and-only-if. No claim in a person's statement calls that person a knave: "I am a knave"
can be said by nobody, which gives the puzzle away (the benchmark leaves it out for that reason).
A draw with no solution or several is thrown away and drawn again.

Deterministic: puzzle i has its own ``random.Random`` seeded from (seed, i), so it is the same whatever
``n`` is and however many puzzles before it needed redraws.
"""

from __future__ import annotations

import random

from grpo.data.knights_knaves.logic import MAX_PEOPLE, And, Iff, Implies, Is, Not, Or, Puzzle, Statement, solve
from grpo.data.knights_knaves.text import SAYINGS

MIN_PEOPLE = 2
# About a third of draws have a single solution, at every size from 2 to 8 people (measured over 400
# draws each), so 1,000 failed draws in a row would mean a bug, not bad luck.
MAX_DRAWS = 1000
FORMS = ("claim", "not", "and", "or", "implies", "iff")

# Common first names (the benchmark's list), so generated quizzes read like its files.
NAMES = (
    "Emma", "Liam", "Olivia", "Noah", "Ava", "Ethan", "Sophia", "Mason", "Isabella", "William", "Mia",
    "James", "Charlotte", "Benjamin", "Amelia", "Lucas", "Harper", "Henry", "Evelyn", "Alexander",
    "Abigail", "Michael", "Emily", "Daniel", "Elizabeth", "Jacob", "Sofia", "Logan", "Avery", "Jackson",
    "Ella", "Sebastian", "Scarlett", "Jack", "Grace", "Aiden", "Chloe", "Owen", "Victoria", "Samuel",
    "Riley", "Matthew", "Aria", "Joseph", "Lily", "Luke", "Aurora", "David", "Zoey", "Oliver", "Penelope",
)


def generate_puzzles(n: int, seed: int, people: tuple[int, int] = (MIN_PEOPLE, MAX_PEOPLE)) -> list[Puzzle]:
    """``n`` puzzles, each with exactly one solution; puzzle i's number of people is drawn uniformly
    from ``people`` (inclusive ``(lo, hi)``, within 2..8), its names from ``NAMES`` (distinct) and
    its sayings from ``text.SAYINGS``. Raises ValueError for bad arguments and RuntimeError if a
    puzzle needs more than ``MAX_DRAWS`` draws."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    check_people(people)
    return [generate_puzzle(seed, index, people) for index in range(n)]


def check_people(people: tuple[int, int]) -> None:
    """Raise ValueError unless ``people`` is ``(lo, hi)`` with ``MIN_PEOPLE <= lo <= hi <= MAX_PEOPLE``."""
    if (not isinstance(people, tuple) or len(people) != 2
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in people)
            or not MIN_PEOPLE <= people[0] <= people[1] <= MAX_PEOPLE):
        raise ValueError(f"people must be (lo, hi) with {MIN_PEOPLE} <= lo <= hi <= {MAX_PEOPLE}, got {people!r}")


def generate_puzzle(seed: int, index: int, people: tuple[int, int]) -> Puzzle:
    """Puzzle ``index`` of the stream ``seed`` (see ``generate_puzzles``)."""
    # A string seed is hashed with SHA-512 by `random`, the same on every run and platform.
    rng = random.Random(f"kk:{seed}:{index}")
    count = rng.randint(*people)
    names = tuple(rng.sample(NAMES, count))
    for _ in range(MAX_DRAWS):
        statements = tuple(draw_statement(rng, speaker, count) for speaker in range(count))
        puzzle = Puzzle(names=names, statements=statements)
        if len(solve(puzzle, max_solutions=2)) == 1:
            sayings = tuple(rng.choice(SAYINGS) for _ in range(count))
            return Puzzle(names=names, statements=statements, sayings=sayings)
    raise RuntimeError(f"K&K puzzle {index} (seed={seed}, {count} people): no draw in {MAX_DRAWS} had exactly "
                       "one solution")


def draw_statement(rng: random.Random, speaker: int, count: int) -> Statement:
    """One statement by person ``speaker`` of ``count``, its form uniform over ``FORMS``."""
    form = rng.choice(FORMS)
    if form == "claim":
        return draw_claim(rng, speaker, count)
    if form == "not":
        return Not(draw_claim(rng, speaker, count))
    first = draw_claim(rng, speaker, count)
    second = draw_claim(rng, speaker, count)
    while second == first:  # "Zoey is a knight and Zoey is a knight" says nothing twice
        second = draw_claim(rng, speaker, count)
    if form == "and":
        return And((first, second))
    if form == "or":
        return Or((first, second))
    if form == "implies":
        return Implies(first, second)
    return Iff(first, second)


def draw_claim(rng: random.Random, speaker: int, count: int) -> Is:
    """"X is a knight/knave" about anyone, the speaker included, but never "<speaker> is a knave"."""
    while True:
        claim = Is(rng.randrange(count), rng.choice(("knight", "knave")))
        if not (claim.person == speaker and claim.role == "knave"):
            return claim
