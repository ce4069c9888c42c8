"""K&K puzzles as ``Example`` records: what the ``kk:`` data source (``grpo.data.sources``) returns.

An Example's one user turn is the quiz text, and its ``answer`` (and ``answer_raw``) the canonical
solution text, which the ``kk_logic`` reward reads the people and their roles from.
"""

from __future__ import annotations

from pathlib import Path

from grpo.data.example import DataError, Example
from grpo.data.knights_knaves.generate import MIN_PEOPLE, check_people, generate_puzzles
from grpo.data.knights_knaves.logic import MAX_PEOPLE, solve
from grpo.data.knights_knaves.reader import read_kk_jsonl
from grpo.data.knights_knaves.text import quiz_text, solution_text


def generated_examples(n: int, seed: int, people: tuple[int, int] = (MIN_PEOPLE, MAX_PEOPLE)) -> list[Example]:
    """``n`` generated puzzles (``generate_puzzles``); ``source`` is "kk(seed=S,people=LO-HI):i", 1-based.
    Raises DataError for a ``people`` range outside what the generator makes."""
    try:
        check_people(people)
    except ValueError as error:
        raise DataError(f"kk data source: {error}") from None
    examples = []
    for index, puzzle in enumerate(generate_puzzles(n, seed, people), start=1):
        (roles,) = solve(puzzle)  # exactly one: the generator's promise
        gold = solution_text(puzzle.names, roles)
        examples.append(Example(messages=[{"role": "user", "content": quiz_text(puzzle)}], answer=gold,
                                answer_raw=gold, source=f"kk(seed={seed},people={people[0]}-{people[1]}):{index}"))
    return examples


def file_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """The quizzes of a public K&K file (``read_kk_jsonl``), quiz text verbatim; ``source`` is "file:line"."""
    return [Example(messages=[{"role": "user", "content": quiz.quiz}], answer=quiz.solution_text,
                    answer_raw=quiz.solution_text, source=quiz.source)
            for quiz in read_kk_jsonl(path, limit=limit)]
