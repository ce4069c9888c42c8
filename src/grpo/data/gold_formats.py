"""Gold-answer formats, looked up by name: how the answer column of a file is turned into a gold.

- ``gsm8k``: a worked solution ending in ``#### N``; the gold is N, which must be a number.
- ``plain``: the cell itself is the gold (text or number).

Both keep the gold as written (``raw``, e.g. "1,080") and a normalised form (``value``, "1080")
that rewards compare against. Thousands commas are removed only when what is left is a number,
so that a text answer like "Paris, France" is not mangled.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.data.example import DataError

GSM8K_MARKER = "####"
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


@dataclass(frozen=True)
class GoldAnswer:
    """A parsed gold answer."""

    value: str  # normalised: stripped, thousands commas removed from numbers
    raw: str  # as written in the file
    solution: str | None  # worked solution before "####" (gsm8k format), else None


def is_number(text: str) -> bool:
    """True if `text` is a plain decimal number such as "72", "-7" or "0.5" (no commas, no units)."""
    return _NUMBER.fullmatch(text) is not None


def normalise_answer(raw: str) -> str:
    """Strip `raw` and drop thousands commas if it is a number ("1,080" -> "1080"); keep text as is."""
    text = raw.strip()
    without_commas = text.replace(",", "")
    return without_commas if is_number(without_commas) else text


def parse_gsm8k_answer(cell: Any, where: str) -> GoldAnswer:
    """Split a GSM8K answer ("...steps...\\n#### 72") into solution and numeric gold.

    Raises DataError (prefixed with `where`) if the cell is not a string, has no or several
    "####" markers, or the text after the marker is not a number.
    """
    if not isinstance(cell, str):
        raise DataError(f"{where}: GSM8K answer must be a string, got {type(cell).__name__}")
    count = cell.count(GSM8K_MARKER)
    if count != 1:
        what = "has no" if count == 0 else f"has {count}"
        raise DataError(
            f"{where}: GSM8K answer {what} '{GSM8K_MARKER}' marker (need exactly one, "
            f"followed by the final number): {_tail(cell)}"
        )
    solution, _, raw = cell.partition(GSM8K_MARKER)
    raw = raw.strip()
    value = normalise_answer(raw)
    if not is_number(value):
        raise DataError(f"{where}: GSM8K gold answer after '{GSM8K_MARKER}' is not a number: {raw!r}")
    return GoldAnswer(value=value, raw=raw, solution=solution.strip() or None)


def parse_plain_answer(cell: Any, where: str) -> GoldAnswer:
    """Use the cell itself as the gold; numbers are accepted and written as text."""
    # bool is an int subclass; a True/False gold is almost surely a wrong column.
    if isinstance(cell, bool) or not isinstance(cell, (str, int, float)):
        raise DataError(f"{where}: answer must be text or a number, got {type(cell).__name__}")
    raw = str(cell).strip()
    if not raw:
        raise DataError(f"{where}: answer is empty")
    return GoldAnswer(value=normalise_answer(raw), raw=raw, solution=None)


ANSWER_FORMATS: dict[str, Callable[[Any, str], GoldAnswer]] = {
    "gsm8k": parse_gsm8k_answer,
    "plain": parse_plain_answer,
}


def get_answer_format(name: str) -> Callable[[Any, str], GoldAnswer]:
    """Look an answer format up by name; an unknown name lists the known ones."""
    try:
        return ANSWER_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown answer format {name!r}; known: {sorted(ANSWER_FORMATS)}") from None


def _tail(text: str, limit: int = 60) -> str:
    """The end of a long answer (where the marker should be), for error messages."""
    return repr(text if len(text) <= limit else "..." + text[-limit:])
