"""Turn a data location (file, folder or Hugging Face hub id) into rows with their locations.

Resolution order, so that a local path always wins over a hub id of the same spelling:
1. an existing folder: the file for the split inside it (`readers.resolve_split_files`);
2. an existing file: that file (the split is ignored);
3. "hf:owner/name" or "owner/name" with no data-file suffix: the hub, through `datasets`;
4. anything else: "file not found".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo.data.example import DataError
from grpo.data.readers import READERS, Row, read_rows, resolve_split_files

HUB_PREFIX = "hf:"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(source: str) -> bool:
    """True for "openai/gsm8k" or "hf:openai/gsm8k"; False for paths such as "data/train.jsonl"."""
    if source.startswith(HUB_PREFIX):
        return True
    return _HUB_ID.fullmatch(source) is not None and Path(source).suffix.lower() not in READERS


def iter_rows(source: str | Path, split: str, hub_config: str | None = None) -> Iterator[Row]:
    """Yield the rows of `source` for `split` (see the module docstring for how `source` is read).

    hub_config: the `datasets` config name used only for hub ids (GSM8K's is "main").
    """
    path = Path(source)
    if path.is_dir():
        for file in resolve_split_files(path, split):
            yield from read_rows(file)
    elif path.is_file():
        yield from read_rows(path)
    elif isinstance(source, str) and looks_like_hub_id(source):
        yield from _hub_rows(source.removeprefix(HUB_PREFIX), hub_config, split)
    else:
        raise DataError(
            f"{source}: file not found (not an existing file or folder, and not a hub dataset id "
            "such as 'openai/gsm8k')"
        )


def _hub_rows(hub_id: str, config: str | None, split: str) -> Iterator[Row]:
    import datasets  # on first use: ~3 s of import (pandas, aiohttp) that a run reading local files never needs
    from datasets.exceptions import DatasetsError  # on first use, with datasets

    try:
        dataset = datasets.load_dataset(hub_id, config, split=split)
    except (OSError, DatasetsError) as err:
        # Offline, `datasets` raises ConnectionError (an OSError); say what to do instead.
        raise DataError(
            f"could not load {hub_id!r} (config {config!r}, split {split!r}) from the Hugging Face "
            f"hub: {err}. Without network access, download the dataset and pass a local file or "
            "folder instead (e.g. a folder holding train.jsonl and test.jsonl)"
        ) from err
    for row_number, record in enumerate(dataset, start=1):
        yield Row(file=f"{hub_id}[{split}]", index=row_number, unit="row", data=dict(record))


def require(row: Row, key: str) -> Any:
    """The value of `key` in the row, or a DataError naming the location and the keys present."""
    if key not in row.data:
        raise DataError(f"{row.where}: missing key {key!r} (keys present: {sorted(row.data)})")
    return row.data[key]


def check_limit(limit: int | None) -> None:
    """Reject a `limit` that is not None or a positive integer."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or a positive integer, got {limit!r}")
