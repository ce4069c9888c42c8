"""SFT pairs for the PTX loss: a chat history ending with a user turn, and the assistant's reply to it.

A row of a jsonl/json/parquet file (or folder, or hub id) gives one pair, read from two columns:
- prompt column a string (GSM8K's ``question``), chat messages ending with a user turn, or PaddleNLP
  ``src`` user turns; the response column a string (GSM8K's ``answer``), or PaddleNLP's ``tgt``
  list, whose last turn is the response and whose earlier turns go between the ``src`` turns;
- or the prompt column alone, chat messages ending with the assistant's reply (TRL's ``messages``).
``response_format`` "gsm8k" rewrites a GSM8K answer ("steps\\n#### N") in the run's tag style, so that
the pairs teach the format the rewards check. Malformed rows raise ``DataError`` naming file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from grpo.data.example import DataError, Example, history_problem
from grpo.data.gold_formats import parse_gsm8k_answer
from grpo.data.locations import iter_rows, require
from grpo.data.prompt_datasets import row_history
from grpo.data.readers import Row
from grpo.data.tags import get_tag_style

RESPONSE_FORMATS = ("plain", "gsm8k")


@dataclass(frozen=True)
class SftPair:
    """One PTX training pair.

    prompt:   the chat history as an RL prompt is held (no system prompt: the run adds its own; ending with
              a user turn; no gold answer), with where it came from, e.g. "sft.jsonl:17".
    response: the assistant's reply, the only text that carries the loss (the EOS is added when tokenized).
    """

    prompt: Example
    response: str

    @property
    def source(self) -> str:
        return self.prompt.source


def load_sft_pairs(source: str | Path, prompt_column: str = "question", response_column: str = "answer",
                   response_format: str = "plain", tag_style: str = "think", split: str = "train") -> list[SftPair]:
    """Every pair of ``source`` (a file, a folder holding ``split``'s file, or a hub id), in file order.

    Raises DataError naming file and 1-based line for a bad row (missing column, empty response, a
    history that does not end with a user turn, a GSM8K answer without "#### N"), and for an empty file.
    """
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(f"unknown response_format {response_format!r}; known: {list(RESPONSE_FORMATS)}")
    style = get_tag_style(tag_style)
    pairs = []
    for row in iter_rows(source, split):
        pair = sft_pair(row, prompt_column, response_column)
        if response_format == "gsm8k":
            gold = parse_gsm8k_answer(pair.response, row.where)
            pair = replace(pair, response=style.completion(gold.solution or "", gold.value))
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{source}: no pairs found")
    return pairs


def sft_pair(row: Row, prompt_column: str, response_column: str) -> SftPair:
    """The pair one row holds (see the module docstring for the accepted layouts)."""
    cell = require(row, prompt_column)
    if isinstance(cell, list) and cell and isinstance(cell[-1], dict) and cell[-1].get("role") == "assistant":
        history, response = cell[:-1], cell[-1].get("content")
        problem = history_problem(history)
        if problem is not None:
            raise DataError(f"{row.where}: column {prompt_column!r} without its final assistant turn: {problem}")
        history = [{"role": turn["role"], "content": turn["content"]} for turn in history]
    else:
        answer = require(row, response_column)
        turns = answer if isinstance(answer, list) and answer else [answer]
        response = turns[-1]
        # The turns before the response are the replies between the user turns (PaddleNLP's src/tgt).
        history = row_history(replace(row, data={**row.data, response_column: turns[:-1]}), prompt_column,
                              tgt_column=response_column)
    if not isinstance(response, str) or not response.strip():
        raise DataError(f"{row.where}: the response ({response_column!r}, or the final assistant turn) must be "
                        f"non-empty text, got {response!r:.80}")
    return SftPair(Example(messages=history, answer=None, answer_raw=None, source=row.where), response)
