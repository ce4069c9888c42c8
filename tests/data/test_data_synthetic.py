"""Synthetic problems: determinism, arithmetic checked from the written chain, difficulty, round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.data import DIFFICULTIES, Example, generate_problems, load_gsm8k, to_gsm8k_record, write_gsm8k_jsonl
from grpo.data.synthetic_templates import COLLECTION

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def checked_chain(example: Example) -> list[tuple[int, str, int, int]]:
    """Re-derive every step from the solution text with plain integer arithmetic; return the steps.

    Independent of the generator's own `OPERATIONS`: a wrong result, an inexact division, a
    negative value, a broken chain or a gold different from the last result all fail here.
    """
    assert example.solution is not None
    steps = []
    for line in example.solution.split("\n"):
        equations = EQUATION.findall(line)
        assert len(equations) == 1, f"expected one equation in {line!r}"
        left, op, right, result = equations[0]
        left, right, result = int(left), int(right), int(result)
        if op == "+":
            expected = left + right
        elif op == "-":
            expected = left - right
        elif op == "*":
            expected = left * right
        else:
            assert right != 0 and left % right == 0, f"inexact division in {line!r}"
            expected = left // right
        assert result == expected, f"wrong arithmetic in {line!r}"
        assert result >= 0
        if steps:
            assert left == steps[-1][3], f"step {line!r} does not continue from the previous result"
        steps.append((left, op, right, result))
    assert example.answer == example.answer_raw == str(steps[-1][3])
    # Every number the solution starts from is given in the question (intermediate results are not).
    given_numbers = set(re.findall(r"\d+", example.question))
    assert str(steps[0][0]) in given_numbers
    assert all(str(right) in given_numbers for _, _, right, _ in steps)
    return steps


def test_same_seed_same_problems_different_seed_different() -> None:
    first = generate_problems(30, seed=123)
    assert first == generate_problems(30, seed=123)
    assert [e.question for e in first] != [e.question for e in generate_problems(30, seed=124)]


def test_a_prefix_does_not_depend_on_n() -> None:
    assert generate_problems(5, seed=9, difficulty="hard") == generate_problems(40, seed=9, difficulty="hard")[:5]


def test_generation_does_not_touch_the_global_random_state() -> None:
    import random

    random.seed(0)
    expected = random.random()
    random.seed(0)
    generate_problems(10, seed=1)
    assert random.random() == expected


def test_answers_are_correct_and_records_well_formed() -> None:
    examples = generate_problems(300, seed=2024)
    for index, example in enumerate(examples, start=1):
        checked_chain(example)
        assert example.source == f"synthetic(seed=2024):{index}"
        assert [m["role"] for m in example.messages] == ["user"]
        assert "####" not in example.question and "####" not in example.solution
        assert example.question.endswith("?")


@pytest.mark.parametrize(("difficulty", "steps", "max_digits"), [("easy", 1, 1), ("medium", 2, 2), ("hard", 3, 3)])
def test_named_levels_give_their_number_of_steps(difficulty: str, steps: int, max_digits: int) -> None:
    assert DIFFICULTIES[difficulty].steps == steps and DIFFICULTIES[difficulty].max_digits == max_digits
    for example in generate_problems(40, seed=5, difficulty=difficulty):
        chain = checked_chain(example)
        assert len(chain) == steps
        # Numbers drawn fresh for additions stay within the digit budget.
        assert all(right < 10**max_digits for _, op, right, _ in chain if op in "+-")


def test_mixed_covers_all_levels_and_overrides_apply() -> None:
    counts = {len(checked_chain(e)) for e in generate_problems(60, seed=3, difficulty="mixed")}
    assert counts == {1, 2, 3}
    overridden = generate_problems(20, seed=3, difficulty="easy", steps=5, max_digits=2)
    assert {len(checked_chain(e)) for e in overridden} == {5}


def test_problems_are_varied() -> None:
    examples = generate_problems(400, seed=11)
    ops = {op for e in examples for _, op, _, _ in checked_chain(e)}
    assert ops == {"+", "-", "*", "/"}
    assert len({e.question for e in examples}) >= 390
    # All four themes show up, each recognised by its final question.
    questions = [e.question for e in examples]
    assert any("How many dollars does" in q for q in questions)
    assert any("How many kilometers is" in q for q in questions)
    assert any(q.startswith(f"{q.split()[0]} bakes") for q in questions)
    assert any(f"How many {item} does" in q for q in questions for item in COLLECTION.vocabulary["item"])


def test_round_trip_through_gsm8k_jsonl(tmp_path: Path) -> None:
    examples = generate_problems(50, seed=77)
    assert all(to_gsm8k_record(e)["answer"].endswith(f"\n#### {e.answer}") for e in examples)
    path = tmp_path / "synthetic.jsonl"
    write_gsm8k_jsonl(examples, path)
    reloaded = load_gsm8k(path)
    assert [(e.question, e.answer, e.solution) for e in reloaded] == [
        (e.question, e.answer, e.solution) for e in examples
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0, "seed": 1}, "n must be a positive integer"),
        ({"n": 3, "seed": "1"}, "seed must be an integer"),
        (
            {"n": 3, "seed": 1, "difficulty": "brutal"},
            r"unknown difficulty 'brutal'; known: \['easy', 'medium', 'hard', 'mixed'\]",
        ),
        ({"n": 3, "seed": 1, "steps": 0}, "steps must be an integer from 1 to 5"),
        ({"n": 3, "seed": 1, "max_digits": 9}, "max_digits must be an integer from 1 to 4"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_problems(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(min_value=-(2**40), max_value=2**40),
    difficulty=st.sampled_from(["easy", "medium", "hard", "mixed"]),
    steps=st.one_of(st.none(), st.integers(min_value=1, max_value=5)),
    max_digits=st.one_of(st.none(), st.integers(min_value=1, max_value=4)),
)
def test_property_every_problem_checks_out(
    seed: int, difficulty: str, steps: int | None, max_digits: int | None
) -> None:
    examples = generate_problems(4, seed, difficulty, steps=steps, max_digits=max_digits)
    assert len(examples) == 4
    for example in examples:
        chain = checked_chain(example)
        if steps is not None:
            assert len(chain) == steps
        assert int(example.answer) >= 0
