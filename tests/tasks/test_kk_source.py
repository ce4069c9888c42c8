"""The ``kk:`` data source end to end: generated puzzles and public files as Examples."""

from __future__ import annotations

import json

import pytest

from grpo.data import DataError, load_dataset_source
from grpo.data.knights_knaves import parse_roles, solution_roles, solve
from grpo.data.knights_knaves.generate import generate_puzzles


def test_generated_examples():
    examples = load_dataset_source("kk:seed=3,n=5,people=3-4")
    puzzles = generate_puzzles(5, seed=3, people=(3, 4))
    assert len(examples) == 5
    for index, (example, puzzle) in enumerate(zip(examples, puzzles), start=1):
        assert example.source == f"kk(seed=3,people=3-4):{index}"
        assert [m["role"] for m in example.messages] == ["user"]
        assert example.question.startswith("A very special island is inhabited only by knights and knaves.")
        assert example.question.endswith("So who is a knight and who is a knave?")
        assert f"You meet {len(puzzle.names)} inhabitants: " in example.question
        assert example.answer == example.answer_raw
        roles = solution_roles(example.answer)
        assert tuple(roles) == puzzle.names and tuple(roles.values()) == solve(puzzle)[0]
        assert parse_roles(example.answer, puzzle.names) == roles  # the gold reads back through parse_roles


def test_deterministic_and_independent_of_n():
    five = load_dataset_source("kk:seed=3,n=5,people=3-4")
    assert load_dataset_source("kk:seed=3,n=5,people=3-4") == five
    assert load_dataset_source("kk:seed=3,n=2,people=3-4") == five[:2]
    assert load_dataset_source("kk:seed=3,n=5,people=3-4", limit=2) == five[:2]
    assert [e.question for e in load_dataset_source("kk:seed=4,n=5,people=3-4")] != [e.question for e in five]
    assert {len(solution_roles(e.answer)) for e in load_dataset_source("kk:seed=1,n=8,people=6")} == {6}
    assert all(2 <= len(solution_roles(e.answer)) <= 8 for e in load_dataset_source("kk:seed=1,n=20"))


@pytest.mark.parametrize(("people", "message"), [
    ("x", "people: expected a count (5) or a range LO-HI (2-8), got 'x'"),
    ("2-", "people: expected a count (5) or a range LO-HI (2-8), got '2-'"),
    ("5-3", "people: expected positive counts with LO <= HI, got '5-3'"),
    ("0", "people: expected positive counts with LO <= HI, got '0'"),
])
def test_bad_people_text(people, message):
    spec = f"kk:seed=1,n=2,people={people}"
    with pytest.raises(DataError) as error:
        load_dataset_source(spec)
    assert str(error.value) == f"data source '{spec}': {message}"


@pytest.mark.parametrize(("spec", "message"), [
    ("kk:seed=1,n=2,people=1-3", "people must be (lo, hi) with 2 <= lo <= hi <= 8, got (1, 3)"),
    ("kk:seed=1,n=2,people=9", "people must be (lo, hi) with 2 <= lo <= hi <= 8, got (9, 9)"),
    ("kk:seed=1", "missing key(s) ['n']"),
    ("kk:path=a.jsonl,seed=1", "path= reads a file and takes no other key"),
])
def test_bad_kk_specs(spec, message):
    with pytest.raises(DataError) as error:
        load_dataset_source(spec)
    assert message in str(error.value)


def test_public_file(tmp_path):
    row = {"quiz": "A very special island ... So who is a knight and who is a knave?", "names": ["Zoey", "Oliver"],
           "solution": [False, True], "solution_text_format": "(1) Zoey is a knave\n(2) Oliver is a knight"}
    path = tmp_path / "people2_num2.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    examples = load_dataset_source(f"kk:path={path}")
    assert len(examples) == 2 and len(load_dataset_source(f"kk:path={path}", limit=1)) == 1
    assert examples[0].question == row["quiz"]
    assert examples[0].answer == examples[0].answer_raw == row["solution_text_format"]
    assert examples[1].source == f"{path}:2"
