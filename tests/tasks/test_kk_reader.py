"""Reading the public K&K files: fields kept verbatim, and errors that name file:line and the field."""

from __future__ import annotations

import json

import pytest

from grpo.data import DataError
from grpo.data.knights_knaves import read_kk_jsonl

# One line of the benchmark's test/people2 file, its unused keys cut short.
LINE = {
    "quiz": "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
            "knaves always lie. You meet 2 inhabitants: Zoey, and Oliver. Zoey remarked, \"Oliver is not a "
            "knight\". Oliver stated, \"Oliver is a knight if and only if Zoey is a knave\". So who is a knight "
            "and who is a knave?",
    "names": ["Zoey", "Oliver"],
    "knight_knave": {"knight": "knight", "knave": "knave"},
    "solution": [False, True],
    "solution_text": "Zoey is a knave, and Oliver is a knight.",
    "solution_text_format": "(1) Zoey is a knave\n(2) Oliver is a knight",
    "statements": "(('not', ('telling-truth', 1)), ('<=>', ('telling-truth', 1), ('lying', 0)))",
    "index": 0,
}


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_reads_quiz_names_and_solution(tmp_path):
    second = {**LINE, "names": ["Emma", "Liam"], "solution": [True, True],
              "solution_text_format": "(1) Emma is a knight\n(2) Liam is a knight"}
    path = _write(tmp_path / "people2_num2.jsonl", [LINE, second])
    first, last = read_kk_jsonl(path)
    assert first.quiz == LINE["quiz"]  # verbatim
    assert first.names == ("Zoey", "Oliver") and first.solution == (False, True)
    assert first.solution_text == LINE["solution_text_format"]
    assert first.source == f"{path}:1" and last.source == f"{path}:2"
    assert last.solution == (True, True)
    assert [q.names for q in read_kk_jsonl(path, limit=1)] == [("Zoey", "Oliver")]


@pytest.mark.parametrize(("change", "message"), [
    ({"quiz": None}, "missing key 'quiz'"),
    ({"solution_text_format": None}, "missing key 'solution_text_format'"),
    ({"names": "Zoey"}, "'names' must be a non-empty list of distinct names"),
    ({"solution": [0, 1]}, "'solution' must be a list of true/false"),
    ({"solution": [True]}, "'solution' has 1 values for 2 names"),
    ({"solution_text_format": "Zoey is a knave"}, "'solution_text_format': K&K solution line 1"),
    ({"solution": [True, True]}, "'solution_text_format' says"),  # disagrees with names and solution
])
def test_errors_name_file_line_and_field(tmp_path, change, message):
    bad = {key: value for key, value in {**LINE, **change}.items() if value is not None}
    path = _write(tmp_path / "kk.jsonl", [LINE, bad])
    with pytest.raises(DataError) as error:
        read_kk_jsonl(path)
    assert str(error.value).startswith(f"{path}:2: ")
    assert message in str(error.value)
