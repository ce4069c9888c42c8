"""Knights-and-Knaves logic: statements, their truth under an assignment, their English, and the solver.

A puzzle has N people; person i is a knight (always tells the truth) or a knave (always lies) and makes
one statement S_i about the roles. An *assignment* is a tuple of N bools, True = knight. It is a solution
when every statement is consistent with its speaker: ``knight_i == holds(S_i, assignment)``.

The English is the K&K benchmark's (Xie et al., "On Memorization of Large Language Models in Logical
Reasoning"; the data Logic-RL trains on): "Oliver is a knight", "Oliver is not a knight",
"Oliver is a knight and Zoey is a knave", "If Oliver is a knave then Zoey is a knight",
"Oliver is a knight if and only if Zoey is a knave". Like the benchmark, only statements whose operands
are plain "X is a knight/knave" claims have an English form: deeper nesting would be ambiguous in prose.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

ROLES = ("knight", "knave")
MAX_PEOPLE = 8  # the solver tries all 2^N assignments; 256 is still instant


@dataclass(frozen=True)
class Is:
    """"<person> is a <role>": person is an index into the puzzle's names."""

    person: int
    role: str  # "knight" or "knave"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Is.role must be one of {list(ROLES)}, got {self.role!r}")
        if isinstance(self.person, bool) or not isinstance(self.person, int) or self.person < 0:
            raise ValueError(f"Is.person must be a non-negative index, got {self.person!r}")


@dataclass(frozen=True)
class Not:
    operand: Statement


@dataclass(frozen=True)
class And:
    operands: tuple[Statement, ...]  # two or more

    def __post_init__(self) -> None:
        _check_operands("And", self)


@dataclass(frozen=True)
class Or:
    operands: tuple[Statement, ...]  # two or more

    def __post_init__(self) -> None:
        _check_operands("Or", self)


@dataclass(frozen=True)
class Implies:
    premise: Statement
    conclusion: Statement


@dataclass(frozen=True)
class Iff:
    left: Statement
    right: Statement


Statement = Is | Not | And | Or | Implies | Iff


@dataclass(frozen=True)
class Puzzle:
    """N people and the statement each makes.

    names:      N distinct first names; statement i is said by names[i].
    statements: N statements, people referred to by index.
    sayings:    how each statement is introduced in the quiz text: a template with ``{name}`` and
                ``{content}`` (``text.SAYINGS``), one per person; empty = the plain one for everybody.
    """

    names: tuple[str, ...]
    statements: tuple[Statement, ...]
    sayings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        if not 1 <= n <= MAX_PEOPLE:
            raise ValueError(f"a puzzle has 1 to {MAX_PEOPLE} people, got {n}")
        if len(set(self.names)) != n or not all(isinstance(x, str) and x.strip() for x in self.names):
            raise ValueError(f"names must be {n} distinct non-empty strings, got {list(self.names)}")
        if len(self.statements) != n:
            raise ValueError(f"{n} people need {n} statements, got {len(self.statements)}")
        if self.sayings and len(self.sayings) != n:
            raise ValueError(f"{n} people need {n} sayings (or none), got {len(self.sayings)}")
        for index, statement in enumerate(self.statements):
            outside = [p for p in people_in(statement) if p >= n]
            if outside:
                raise ValueError(f"statement {index} ({_short(statement)}) names person {outside[0]}, "
                                 f"but the puzzle has {n} people")


def holds(statement: Statement, assignment: tuple[bool, ...]) -> bool:
    """Whether ``statement`` is true when person i is a knight exactly if ``assignment[i]``."""
    match statement:
        case Is(person, role):
            return assignment[person] == (role == "knight")
        case Not(operand):
            return not holds(operand, assignment)
        case And(operands):
            return all(holds(s, assignment) for s in operands)
        case Or(operands):
            return any(holds(s, assignment) for s in operands)
        case Implies(premise, conclusion):
            return not holds(premise, assignment) or holds(conclusion, assignment)
        case Iff(left, right):
            return holds(left, assignment) == holds(right, assignment)
    raise TypeError(f"not a statement: {statement!r}")


def is_consistent(puzzle: Puzzle, assignment: tuple[bool, ...]) -> bool:
    """Whether every person's statement is true exactly when that person is a knight."""
    return all(knight == holds(s, assignment) for knight, s in zip(assignment, puzzle.statements, strict=True))


def solve(puzzle: Puzzle, max_solutions: int | None = None) -> list[tuple[bool, ...]]:
    """Every consistent assignment, by brute force over the 2^N of them (all knights first, as
    ``itertools.product((True, False), ...)`` orders them). ``max_solutions`` stops early: the
    generator only needs to know whether there is more than one."""
    solutions = []
    for assignment in itertools.product((True, False), repeat=len(puzzle.names)):
        if is_consistent(puzzle, assignment):
            solutions.append(assignment)
            if max_solutions is not None and len(solutions) >= max_solutions:
                break
    return solutions


def people_in(statement: Statement) -> list[int]:
    """The person indices a statement names, in order of appearance (with repeats)."""
    match statement:
        case Is(person, _):
            return [person]
        case Not(operand):
            return people_in(operand)
        case And(operands) | Or(operands):
            return [p for s in operands for p in people_in(s)]
        case Implies(first, second) | Iff(first, second):
            return people_in(first) + people_in(second)
    raise TypeError(f"not a statement: {statement!r}")


def statement_text(statement: Statement, names: tuple[str, ...] | list[str]) -> str:
    """The benchmark's English for a statement (see the module docstring), without final punctuation.

    Raises ValueError for a statement the benchmark has no English for (an operand that is not a
    plain claim), rather than writing prose whose grouping a reader could not recover."""
    match statement:
        case Is():
            return _claim(statement, names)
        case Not(Is() as claim):
            return _claim(claim, names, negated=True)
        case And(operands):
            return " and ".join(_claim(_plain(s, statement), names) for s in operands)
        case Or(operands):
            return " or ".join(_claim(_plain(s, statement), names) for s in operands)
        case Implies(premise, conclusion):
            # "If" keeps its capital inside a sentence too ("David said that If ..."), as in the benchmark.
            return (f"If {_claim(_plain(premise, statement), names)} "
                    f"then {_claim(_plain(conclusion, statement), names)}")
        case Iff(left, right):
            return (f"{_claim(_plain(left, statement), names)} if and only if "
                    f"{_claim(_plain(right, statement), names)}")
        case Not(operand):
            _plain(operand, statement)  # raises: only "X is not a knight/knave" has an English form
    raise TypeError(f"not a statement: {statement!r}")


def _short(statement: Statement) -> str:
    text = repr(statement)
    return text if len(text) <= 80 else text[:77] + "..."


def _claim(claim: Is, names: tuple[str, ...] | list[str], negated: bool = False) -> str:
    return f"{names[claim.person]} is {'not ' if negated else ''}a {claim.role}"


def _plain(operand: Statement, parent: Statement) -> Is:
    if not isinstance(operand, Is):
        raise ValueError(f"no English for {_short(parent)}: the benchmark's English only has "
                         "operands that are plain 'X is a knight/knave' claims")
    return operand


def _check_operands(kind: str, statement: And | Or) -> None:
    operands = tuple(statement.operands)
    object.__setattr__(statement, "operands", operands)  # a list given by a caller becomes a tuple (hashable)
    if len(operands) < 2:
        raise ValueError(f"{kind} needs two or more operands, got {len(operands)}")
