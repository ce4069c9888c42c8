"""Prompt datasets other than GSM8K: any jsonl/json/parquet file (or folder, or hub id) of prompts.

The question cell of a row may be:
- a string: one user turn;
- a list of chat messages ``[{"role": "user"|"assistant", "content": ...}, ...]`` ending with a
  user turn;
- a list of strings: PaddleNLP's ``src``/``tgt`` multi-turn format, where ``src`` holds the user
  turns and ``tgt`` the assistant turns between them (``len(tgt) == len(src) - 1``), giving
  user/assistant/.../user. With ``question_column="src"`` a plain string ``src`` is one turn.
An optional answer column is parsed by a named answer format ("plain" or "gsm8k").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.data.example import DataError, Example, history_problem
from grpo.data.gold_formats import get_answer_format
from grpo.data.locations import check_limit, iter_rows, require
from grpo.data.readers import Row

PADDLE_SRC = "src"


def load_prompts(
    source: str | Path,
    question_column: str = "question",
    answer_column: str | None = None,
    answer_format: str = "plain",
    limit: int | None = None,
    split: str = "train",
    tgt_column: str = "tgt",
) -> list[Example]:
    """Load prompts (and optional golds) from a file, a folder (picking `split`) or a hub id.

    question_column: column with the question: text, chat messages, or src-style user turns.
    answer_column:   column with the gold answer, or None for prompts without golds.
    answer_format:   how the answer cell is read: "plain" (the cell is the gold) or "gsm8k"
                     (text ending in "#### N").
    limit:           keep only the first `limit` examples.
    tgt_column:      column with the assistant turns for src-style histories.
    Raises DataError naming file and 1-based line for malformed rows, and for an empty file.
    """
    check_limit(limit)
    parse_answer = get_answer_format(answer_format)  # unknown names fail before any file is read
    examples: list[Example] = []
    for row in iter_rows(source, split):
        if limit is not None and len(examples) >= limit:
            break
        messages = row_history(row, question_column, tgt_column)
        answer = answer_raw = solution = None
        if answer_column is not None:
            gold = parse_answer(require(row, answer_column), row.where)
            answer, answer_raw, solution = gold.value, gold.raw, gold.solution
        examples.append(
            Example(messages=messages, answer=answer, answer_raw=answer_raw, source=row.where, solution=solution)
        )
    if not examples:
        raise DataError(f"{source}: no examples found")
    return examples


def row_history(row: Row, question_column: str, tgt_column: str = "tgt") -> list[dict[str, str]]:
    """The chat history (user/assistant turns ending with a user turn) held by one row."""
    cell = require(row, question_column)
    if isinstance(cell, str):
        if question_column == PADDLE_SRC:
            return paddle_history(row, [cell], tgt_column)
        if not cell.strip():
            raise DataError(f"{row.where}: column {question_column!r} is empty")
        return [{"role": "user", "content": cell}]
    if isinstance(cell, list) and cell and all(isinstance(turn, str) for turn in cell):
        return paddle_history(row, cell, tgt_column)
    if isinstance(cell, list) and cell and all(isinstance(turn, dict) for turn in cell):
        problem = history_problem(cell)
        if problem is not None:
            raise DataError(f"{row.where}: column {question_column!r}: {problem}")
        # Keep only role and content: extra keys (names, ids) mean nothing to the chat template.
        return [{"role": turn["role"], "content": turn["content"]} for turn in cell]
    raise DataError(
        f"{row.where}: column {question_column!r} must be a string, a list of chat messages "
        f"({{'role', 'content'}} dicts) or a list of user turns (src/tgt format), got {cell!r:.80}"
    )


def paddle_history(row: Row, src: list[str], tgt_column: str = "tgt") -> list[dict[str, str]]:
    """Interleave PaddleNLP user turns `src` with the assistant turns in `row[tgt_column]`.

    `tgt` may be missing, None or "" only when there is a single user turn; a string `tgt` is one
    assistant turn. Raises DataError unless ``len(tgt) == len(src) - 1``.
    """
    tgt_cell = row.data.get(tgt_column)
    if tgt_cell is None or tgt_cell == "":
        tgt: list[Any] = []
    elif isinstance(tgt_cell, str):
        tgt = [tgt_cell]
    elif isinstance(tgt_cell, list):
        tgt = tgt_cell
    else:
        raise DataError(f"{row.where}: {tgt_column!r} must be a string or a list of strings, got {tgt_cell!r:.80}")
    if not all(isinstance(turn, str) for turn in tgt):
        raise DataError(f"{row.where}: {tgt_column!r} must hold only strings, got {tgt!r:.80}")
    if len(tgt) != len(src) - 1:
        raise DataError(
            f"{row.where}: src/tgt lengths do not match: {len(src)} user turn(s) in 'src' need "
            f"{len(src) - 1} assistant turn(s) in {tgt_column!r} (the replies between them), got {len(tgt)}; "
            "a final reference reply belongs in the answer column"
        )
    messages: list[dict[str, str]] = []
    for index, user_turn in enumerate(src):
        if not user_turn.strip():
            raise DataError(f"{row.where}: user turn {index} in 'src' is empty")
        messages.append({"role": "user", "content": user_turn})
        if index < len(tgt):
            messages.append({"role": "assistant", "content": tgt[index]})
    return messages
