"""The weight store's file operations: JSON that a peft config can become, fsync of files and folders,
and reads that turn a missing, torn or corrupt file into a ``WeightStoreError`` naming it."""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Any

from grpo.run.durable import fsync_dir as _fsync_dir  # noqa: F401  (shared with grpo.run.checkpoint)
from grpo.run.durable import fsync_file as _fsync_file  # noqa: F401
from grpo.weight_store.layout import WeightStoreError

_HASH_CHUNK = 1 << 20


def _json_safe(value: Any) -> Any:
    """A peft config dict as JSON: sets -> sorted lists, enums -> their values, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return _json_safe(value.value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"adapter_config holds a {type(value).__name__} ({value!r}), which JSON cannot store")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WeightStoreError(f"{path} cannot be read ({err}); the version is torn or corrupt") from err


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError as err:
        raise WeightStoreError(f"{path} is missing ({err}); the version is torn or was pruned") from err
    return st.st_ino, st.st_size, st.st_mtime_ns


def _verify_file(path: Path, entry: dict[str, Any], stat: tuple[int, int, int]) -> None:
    size = stat[1]
    if size != entry["bytes"]:
        raise WeightStoreError(f"{path} has {size} bytes but the manifest says {entry['bytes']}; the file is torn")
    try:
        digest = _sha256(path)
    except OSError as err:
        raise WeightStoreError(f"{path} cannot be read ({err})") from err
    if digest != entry["sha256"]:
        raise WeightStoreError(f"{path} does not match its SHA-256 in the manifest; the file is corrupt")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
