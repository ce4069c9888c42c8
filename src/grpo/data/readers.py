"""Read rows (plain dicts) from local `.jsonl`, `.json` and `.parquet` files, each with its location.

Every row carries the 1-based line (text files) or row number (parquet) it came from, so that the
loaders above can say "train.jsonl:17: missing key 'answer'" instead of "KeyError: 'answer'".
Readers are looked up by file suffix in `READERS`; an unknown suffix lists the known ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet

from grpo.data.example import DataError


@dataclass(frozen=True)
class Row:
    """One record of a data file: its contents and where it is."""

    file: str  # the file as the user named it (or a hub id with its split)
    index: int  # 1-based line number (text files) or row number (parquet, hub)
    unit: str  # "line" or "row": what `index` counts
    data: dict[str, Any]

    @property
    def where(self) -> str:
        """Location for messages: "file.jsonl:17" for lines, "file.parquet:row 17" for rows."""
        return f"{self.file}:{self.index}" if self.unit == "line" else f"{self.file}:row {self.index}"


def read_rows(path: Path) -> Iterator[Row]:
    """Yield the rows of one data file in order; raise DataError naming file and line on bad input.

    Blank lines of a `.jsonl` file are skipped. A `.json` file is either one JSON array of objects
    or JSON lines (what `datasets.Dataset.to_json` writes). An empty file is an error.
    """
    try:
        reader = READERS[path.suffix.lower()]
    except KeyError:
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; supported: {sorted(READERS)}"
        ) from None
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    empty = True
    for row in reader(path):
        empty = False
        yield row
    if empty:
        raise DataError(f"{path}: file is empty (no records)")


def _read_jsonl(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{line_number}: invalid JSON ({err.msg} at column {err.colno})"
                ) from None
            yield _as_row(path, line_number, "line", value)


def _read_json(path: Path) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8")
    start = _skip_space(text, 0)
    if start == len(text):
        return
    if text[start] != "[":
        # Not an array: JSON lines in a .json file, as datasets' to_json() writes them.
        yield from _read_jsonl(path)
        return
    yield from _read_json_array(path, text, start)


def _read_json_array(path: Path, text: str, start: int) -> Iterator[Row]:
    """Parse a JSON array element by element, so each element knows the line it starts on."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, start + 1)
    line_number, counted_to = 1, 0
    if position < len(text) and text[position] == "]":
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
        # Count newlines incrementally: recounting from 0 for each element would be quadratic.
        line_number += text.count("\n", counted_to, position)
        counted_to = position
        yield _as_row(path, line_number, "line", value)
        position = _skip_space(text, end)
        if position < len(text) and text[position] == ",":
            position = _skip_space(text, position + 1)
            continue
        if position < len(text) and text[position] == "]":
            if _skip_space(text, position + 1) != len(text):
                raise DataError(f"{path}:{_line_of(text, position + 1)}: unexpected text after the JSON array")
            return
        raise DataError(f"{path}:{_line_of(text, position)}: invalid JSON array (expected ',' or ']')")


def _read_parquet(path: Path) -> Iterator[Row]:
    for row_number, value in enumerate(pyarrow.parquet.read_table(path).to_pylist(), start=1):
        yield _as_row(path, row_number, "row", value)


READERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def resolve_split_files(directory: Path, split: str) -> list[Path]:
    """The file(s) holding `split` inside a dataset folder.

    Looked for in order: `{split}.jsonl`, `{split}.parquet`, `{split}.json` (the first found wins),
    then parquet shards named `{split}-*.parquet` (the Hugging Face hub layout), in sorted order.
    """
    for suffix in (".jsonl", ".parquet", ".json"):
        candidate = directory / f"{split}{suffix}"
        if candidate.is_file():
            return [candidate]
    shards = sorted(directory.glob(f"{split}-*.parquet"))
    if shards:
        return shards
    present = sorted(p.name for p in directory.iterdir())
    raise DataError(
        f"{directory}: no file for split {split!r}; looked for {split}.jsonl, {split}.parquet, "
        f"{split}.json and {split}-*.parquet; the folder holds {present}"
    )


def _as_row(path: Path, index: int, unit: str, value: Any) -> Row:
    row = Row(file=str(path), index=index, unit=unit, data=value if isinstance(value, dict) else {})
    if not isinstance(value, dict):
        raise DataError(f"{row.where}: expected a JSON object, got {type(value).__name__}")
    return row


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1
