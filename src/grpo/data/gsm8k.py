"""GSM8K: grade-school math word problems with a worked solution ending in "#### N".

Each row is ``{"question": str, "answer": "...steps...\\n#### N"}``; the gold is N (a number,
thousands commas allowed in the file). Also writes examples back in this format, so that
generated problems can be saved and reloaded like the real data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from grpo.data.example import DataError, Example
from grpo.data.gold_formats import GSM8K_MARKER, parse_gsm8k_answer
from grpo.data.locations import check_limit, iter_rows, require
from grpo.data.readers import Row

GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_HUB_CONFIG = "main"


def load_gsm8k(
    source: str | Path,
    split: str = "train",
    limit: int | None = None,
    hub_config: str | None = GSM8K_HUB_CONFIG,
) -> list[Example]:
    """Load GSM8K-format examples.

    source:     a `.jsonl`/`.json`/`.parquet` file; a folder holding `{split}.jsonl` (or
                `.parquet`/`.json`, or `{split}-*.parquet` shards); or a hub id such as
                "openai/gsm8k" (needs network; `hub_config` is its config name).
    split:      which split to pick from a folder or the hub; ignored for a single file.
    limit:      keep only the first `limit` examples (rows after them are not read).
    Returns the examples in file order. Raises DataError naming the file and 1-based line for a
    malformed line, a missing key, a missing "####" or a non-numeric gold, and for an empty file.
    """
    check_limit(limit)
    examples: list[Example] = []
    for row in iter_rows(source, split, hub_config):
        if limit is not None and len(examples) >= limit:
            break
        examples.append(gsm8k_example(row))
    if not examples:
        raise DataError(f"{source}: no examples found")
    return examples


def gsm8k_example(row: Row) -> Example:
    """Turn one GSM8K row into an Example (single user turn, numeric gold, worked solution)."""
    question = require(row, "question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{row.where}: 'question' must be a non-empty string, got {question!r:.80}")
    gold = parse_gsm8k_answer(require(row, "answer"), row.where)
    return Example(
        messages=[{"role": "user", "content": question.strip()}],
        answer=gold.value,
        answer_raw=gold.raw,
        source=row.where,
        solution=gold.solution,
    )


def to_gsm8k_record(example: Example) -> dict[str, str]:
    """The GSM8K row for an example: ``{"question", "answer": "<solution>\\n#### <gold>"}``.

    Only single-turn examples with a gold answer can be written; the solution is omitted when
    the example has none. `load_gsm8k` of the written file gives the example back (with the
    file's location as `source`).
    """
    if example.answer_raw is None:
        raise ValueError(f"{example.source}: cannot write a GSM8K record without a gold answer")
    if len(example.messages) != 1:
        raise ValueError(
            f"{example.source}: GSM8K records hold one question, but this example has "
            f"{len(example.messages)} messages"
        )
    final = f"{GSM8K_MARKER} {example.answer_raw}"
    answer = f"{example.solution}\n{final}" if example.solution else final
    return {"question": example.question, "answer": answer}


def write_gsm8k_jsonl(examples: Iterable[Example], path: str | Path) -> int:
    """Write examples as GSM8K JSON lines to `path` (overwritten); return the number written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as handle:
        for example in examples:
            handle.write(json.dumps(to_gsm8k_record(example), ensure_ascii=False) + "\n")
            count += 1
    return count
