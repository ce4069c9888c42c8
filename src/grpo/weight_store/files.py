"""The weight store's file operations: JSON that a peft config can become, fsync of files and folders,
reads that turn a missing, torn or corrupt file into a ``WeightStoreError`` naming it, and the retry of
a read that NFS answers with a stale file handle."""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import safetensors.torch
import torch
from safetensors import SafetensorError

from grpo.run.durable import fsync_dir as _fsync_dir  # noqa: F401  (shared with grpo.run.checkpoint)
from grpo.run.durable import fsync_file as _fsync_file  # noqa: F401
from grpo.weight_store.layout import WeightStoreError

_HASH_CHUNK = 1 << 20
T = TypeVar("T")


class FileVanishedError(WeightStoreError):
    """A file the manifest lists is gone (ENOENT) or its NFS handle is stale (ESTALE): what a concurrent
    prune looks like to a reader, so ``WeightStore.load`` reads the version again before giving up."""


def _vanished(err: OSError) -> bool:
    return isinstance(err, FileNotFoundError) or err.errno == errno.ESTALE


def _unreadable(path: Path, err: OSError, what: str) -> WeightStoreError:
    """The error for a failed read of ``path``; a vanished file's is a ``FileVanishedError`` (worth a retry)."""
    if _vanished(err):
        return FileVanishedError(f"{path} {what} ({err}); the version is torn or was pruned")
    return WeightStoreError(f"{path} {what} ({err})")


def _retry_stale(read: Callable[[], T], tries: int, pause_s: float) -> T:
    """``read()``, tried up to ``tries`` times while NFS answers ESTALE (the client cached a handle of a file
    that was replaced or removed on the server; a fresh lookup usually works), pausing ``pause_s``, doubled
    after each try. The last try's error is raised."""
    for attempt in range(tries - 1):
        try:
            return read()
        except OSError as err:
            if err.errno != errno.ESTALE:
                raise
        time.sleep(pause_s * 2 ** attempt)
    return read()


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
    except OSError as err:
        raise _unreadable(path, err, "cannot be read") from err
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WeightStoreError(f"{path} cannot be read ({err}); the version is torn or corrupt") from err


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(path, device="cpu")
    except OSError as err:
        raise _unreadable(path, err, "cannot be read") from err
    except SafetensorError as err:
        raise WeightStoreError(f"{path} cannot be read ({err}); the version is torn or corrupt") from err


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError as err:
        raise _unreadable(path, err, "is missing") from err
    return st.st_ino, st.st_size, st.st_mtime_ns


def _verify_file(path: Path, entry: dict[str, Any], stat: tuple[int, int, int]) -> None:
    size = stat[1]
    if size != entry["bytes"]:
        raise WeightStoreError(f"{path} has {size} bytes but the manifest says {entry['bytes']}; the file is torn")
    try:
        digest = _sha256(path)
    except OSError as err:
        raise _unreadable(path, err, "cannot be read") from err
    if digest != entry["sha256"]:
        raise WeightStoreError(f"{path} does not match its SHA-256 in the manifest; the file is corrupt")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
