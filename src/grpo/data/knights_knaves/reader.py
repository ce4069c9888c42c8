"""The public K&K files (Xie et al.'s ``kk`` dataset, e.g. ``test/people3_num100.jsonl``), one quiz a line.

Each line is a JSON object; of its keys these are read:
    quiz                  the puzzle as the model reads it (kept verbatim)
    names                 the people, in the order of ``solution``
    solution              one bool per person, True = knight
    solution_text_format  the graded answer, "(1) Zoey is a knave\\n(2) Oliver is a knight"
The others (``cot_*``, ``statements``, ``knight_knave``, ...) are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo.data.example import DataError
from grpo.data.knights_knaves.text import solution_roles, solution_text
from grpo.data.locations import check_limit, require
from grpo.data.readers import Row, read_rows


@dataclass(frozen=True)
class PublishedQuiz:
    """One quiz of a public K&K file.

    quiz:          the quiz text, verbatim.
    names:         the N people.
    solution:      N bools, True = knight.
    solution_text: the canonical answer (``text.solution_text``), checked equal to the file's
                   ``solution_text_format``.
    source:        "file.jsonl:LINE".
    """

    quiz: str
    names: tuple[str, ...]
    solution: tuple[bool, ...]
    solution_text: str
    source: str


def read_kk_jsonl(path: str | Path, limit: int | None = None) -> list[PublishedQuiz]:
    """The quizzes of one K&K file (the first ``limit`` if given). Raises DataError naming file:line and
    the key for a missing or malformed field, and for a solution text that disagrees with ``names`` and
    ``solution`` (a gold answer that could be read two ways is worse than none)."""
    check_limit(limit)
    quizzes: list[PublishedQuiz] = []
    for row in read_rows(Path(path)):
        if limit is not None and len(quizzes) >= limit:
            break
        quizzes.append(published_quiz(row))
    return quizzes


def published_quiz(row: Row) -> PublishedQuiz:
    """One row of a K&K file, checked (see ``read_kk_jsonl``)."""
    quiz = require(row, "quiz")
    if not isinstance(quiz, str) or not quiz.strip():
        raise DataError(f"{row.where}: 'quiz' must be a non-empty string, got {quiz!r:.80}")
    names = require(row, "names")
    if (not isinstance(names, list) or not names or not all(isinstance(x, str) and x.strip() for x in names)
            or len(set(names)) != len(names)):
        raise DataError(f"{row.where}: 'names' must be a non-empty list of distinct names, got {names!r:.80}")
    solution = require(row, "solution")
    if not isinstance(solution, list) or not all(isinstance(x, bool) for x in solution):
        raise DataError(f"{row.where}: 'solution' must be a list of true/false (true = knight), got {solution!r:.80}")
    if len(solution) != len(names):
        raise DataError(f"{row.where}: 'solution' has {len(solution)} values for {len(names)} names")
    written = require(row, "solution_text_format")
    if not isinstance(written, str):
        raise DataError(f"{row.where}: 'solution_text_format' must be a string, got {written!r:.80}")
    try:
        written_roles = solution_roles(written)
    except ValueError as error:
        raise DataError(f"{row.where}: 'solution_text_format': {error}") from None
    expected = dict(zip(names, solution, strict=True))
    if list(written_roles.items()) != list(expected.items()):
        raise DataError(f"{row.where}: 'solution_text_format' says {written_roles} but 'names' and 'solution' "
                        f"say {expected}")
    return PublishedQuiz(quiz=quiz, names=tuple(names), solution=tuple(solution),
                         solution_text=solution_text(names, solution), source=row.where)
