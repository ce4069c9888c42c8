"""Knights-and-Knaves logic puzzles (the K&K benchmark of Xie et al.; the task Logic-RL trains on).

- ``logic``:    statements (Is, Not, And, Or, Implies, Iff), ``holds``, their English, ``Puzzle``, ``solve``
- ``generate``: ``generate_puzzles``: deterministic puzzles with exactly one solution, 2-8 people
- ``text``:     the quiz text, the canonical solution text, ``parse_roles`` (claims read out of an answer)
- ``reader``:   ``read_kk_jsonl``: the public K&K files, quiz text verbatim
- ``examples``: puzzles and files as ``Example`` records (the ``kk:`` data source)

The Logic-RL rule reward over these puzzles (``kk_logic``) is ``grpo.rewards.knights_knaves``.
"""

from grpo.data.knights_knaves.generate import NAMES, generate_puzzles
from grpo.data.knights_knaves.logic import (
    ROLES,
    And,
    Iff,
    Implies,
    Is,
    Not,
    Or,
    Puzzle,
    Statement,
    holds,
    is_consistent,
    solve,
    statement_text,
)
from grpo.data.knights_knaves.reader import PublishedQuiz, read_kk_jsonl
from grpo.data.knights_knaves.text import parse_roles, quiz_text, solution_roles, solution_text

__all__ = [
    "NAMES",
    "ROLES",
    "And",
    "Iff",
    "Implies",
    "Is",
    "Not",
    "Or",
    "PublishedQuiz",
    "Puzzle",
    "Statement",
    "generate_puzzles",
    "holds",
    "is_consistent",
    "parse_roles",
    "quiz_text",
    "read_kk_jsonl",
    "solution_roles",
    "solution_text",
    "solve",
    "statement_text",
]
