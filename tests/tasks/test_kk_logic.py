"""K&K logic: truth of statements, the solver on hand-solved puzzles, English of every form, and the
generator's promise (exactly one solution, which every statement agrees with)."""

from __future__ import annotations

import pytest

from grpo.data.knights_knaves import And, Iff, Implies, Is, Not, Or, Puzzle, generate_puzzles, holds, solve
from grpo.data.knights_knaves.logic import statement_text

NAMES = ("Zoey", "Oliver", "Emma")
T, F = True, False  # knight, knave


def test_holds_follows_the_truth_tables():
    zoey_knight, oliver_knave = Is(0, "knight"), Is(1, "knave")
    for zoey in (T, F):
        for oliver in (T, F):
            a, b = zoey, not oliver  # the truth of each claim under this assignment
            assignment = (zoey, oliver)
            assert holds(zoey_knight, assignment) == a
            assert holds(oliver_knave, assignment) == b
            assert holds(Not(zoey_knight), assignment) == (not a)
            assert holds(And((zoey_knight, oliver_knave)), assignment) == (a and b)
            assert holds(Or((zoey_knight, oliver_knave)), assignment) == (a or b)
            assert holds(Implies(zoey_knight, oliver_knave), assignment) == ((not a) or b)
            assert holds(Iff(zoey_knight, oliver_knave), assignment) == (a == b)


def test_and_or_take_more_than_two_operands_and_need_two():
    three = (Is(0, "knight"), Is(1, "knight"), Is(2, "knave"))
    assert holds(And(three), (T, T, F)) and not holds(And(three), (T, T, T))
    assert holds(Or(three), (F, F, F)) and not holds(Or(three), (F, F, T))
    with pytest.raises(ValueError, match="two or more operands"):
        And((Is(0, "knight"),))
    with pytest.raises(ValueError, match="role must be one of"):
        Is(0, "squire")


# Hand-solved puzzles: statements, then every consistent assignment in the solver's order (knights first).
HAND_SOLVED = [
    # Zoey: "Oliver is a knave". Oliver: "Zoey and I are knights".
    # Oliver a knight would make Zoey a knight calling him a knave: no. So Oliver is a knave, his claim is
    # false (fine), and Zoey, who says so truly, is a knight.
    ((Is(1, "knave"), And((Is(0, "knight"), Is(1, "knight")))), [(T, F)]),
    # Zoey: "Zoey is a knight if and only if Oliver is a knave". Oliver: "Zoey is not a knight".
    # (T, F): Zoey's claim T<->T true, Oliver's "not T" false: consistent. (F, T): Zoey's F<->F true but
    # she is a knave: no. (T, T): Zoey's T<->F false: no. (F, F): Oliver's "not F" true, he a knave: no.
    ((Iff(Is(0, "knight"), Is(1, "knave")), Not(Is(0, "knight"))), [(T, F)]),
    # Zoey: "If Oliver is a knight then Zoey is a knave". Oliver: "Zoey is a knave or Oliver is a knight".
    # Zoey a knave: her claim must be false, so Oliver is a knight and Zoey a knight: contradiction.
    # So Zoey is a knight, her claim true, so Oliver is a knave; his "F or F" is false: consistent.
    ((Implies(Is(1, "knight"), Is(0, "knave")), Or((Is(0, "knave"), Is(1, "knight")))), [(T, F)]),
    # Zoey: "Oliver is a knight". Oliver: "Zoey is a knight". Both knights or both knaves: two solutions.
    ((Is(1, "knight"), Is(0, "knight")), [(T, T), (F, F)]),
    # Zoey: "Zoey is a knave" (the liar's paradox): no solution, whatever Oliver says.
    ((Is(0, "knave"), Is(1, "knight")), []),
    # Three people. Zoey: "Emma is a knave". Oliver: "Zoey is a knight and Emma is a knight".
    # Emma: "Oliver is a knave". Oliver a knight needs Zoey and Emma knights, but knight Zoey calls Emma a
    # knave: no. So Oliver is a knave and Emma (who says so) a knight, and Zoey, calling her a knave, a knave.
    ((Is(2, "knave"), And((Is(0, "knight"), Is(2, "knight"))), Is(1, "knave")), [(F, F, T)]),
]


@pytest.mark.parametrize(("statements", "expected"), HAND_SOLVED)
def test_solver_on_hand_solved_puzzles(statements, expected):
    puzzle = Puzzle(names=NAMES[:len(statements)], statements=statements)
    assert solve(puzzle) == expected


def test_puzzle_checks_its_people():
    with pytest.raises(ValueError, match="names person 2, but the puzzle has 2 people"):
        Puzzle(names=("Zoey", "Oliver"), statements=(Is(2, "knight"), Is(0, "knight")))
    with pytest.raises(ValueError, match="distinct"):
        Puzzle(names=("Zoey", "Zoey"), statements=(Is(1, "knight"), Is(0, "knight")))


@pytest.mark.parametrize(("statement", "english"), [
    (Is(1, "knight"), "Oliver is a knight"),
    (Is(0, "knave"), "Zoey is a knave"),
    (Not(Is(1, "knight")), "Oliver is not a knight"),
    (And((Is(1, "knight"), Is(0, "knave"))), "Oliver is a knight and Zoey is a knave"),
    (Or((Is(1, "knight"), Is(0, "knight"))), "Oliver is a knight or Zoey is a knight"),
    (Or((Is(1, "knight"), Is(0, "knight"), Is(2, "knave"))), "Oliver is a knight or Zoey is a knight or Emma is a knave"),
    (Implies(Is(1, "knave"), Is(0, "knight")), "If Oliver is a knave then Zoey is a knight"),
    (Iff(Is(1, "knight"), Is(0, "knave")), "Oliver is a knight if and only if Zoey is a knave"),
])
def test_english_of_each_form(statement, english):
    assert statement_text(statement, NAMES) == english


def test_nested_statements_have_no_english():
    with pytest.raises(ValueError, match="no English for"):
        statement_text(And((Is(0, "knight"), Not(Is(1, "knight")))), NAMES)
    with pytest.raises(ValueError, match="no English for"):
        statement_text(Not(Not(Is(0, "knight"))), NAMES)


@pytest.mark.parametrize("people", range(2, 9))
def test_generated_puzzles_have_exactly_one_solution(people):
    for seed in range(30):
        for puzzle in generate_puzzles(2, seed, people=(people, people)):
            assert len(puzzle.names) == people
            (solution,) = solve(puzzle)
            # Checked again here without the solver: each speaker's statement is true exactly when a knight.
            assert all(knight == holds(s, solution) for knight, s in zip(solution, puzzle.statements))
            for speaker, statement in enumerate(puzzle.statements):
                assert Is(speaker, "knave") not in _claims(statement)  # "I am a knave" gives it away
                statement_text(statement, puzzle.names)  # every generated form has its English


def test_generation_is_deterministic_per_seed_and_index():
    assert generate_puzzles(6, seed=4) == generate_puzzles(6, seed=4)
    assert generate_puzzles(3, seed=4) == generate_puzzles(6, seed=4)[:3]  # puzzle i does not depend on n
    assert generate_puzzles(6, seed=4) != generate_puzzles(6, seed=5)
    counts = {len(p.names) for p in generate_puzzles(60, seed=0)}
    assert counts == set(range(2, 9))  # the default range, every size drawn
    with pytest.raises(ValueError, match="people must be"):
        generate_puzzles(1, seed=0, people=(1, 3))
    with pytest.raises(ValueError, match="people must be"):
        generate_puzzles(1, seed=0, people=(5, 4))


def _claims(statement):
    match statement:
        case Is():
            return [statement]
        case Not(operand):
            return _claims(operand)
        case And(operands) | Or(operands):
            return [c for s in operands for c in _claims(s)]
        case Implies(a, b) | Iff(a, b):
            return _claims(a) + _claims(b)
