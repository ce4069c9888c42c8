"""Crash-safe file helpers shared by every writer that must survive a kill (checkpoints, published weights):
fsync, and folders moved into place by rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush a written file's data to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, a rename) durable; only possible on POSIX."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """``os.replace`` for folders, also when ``dst`` exists (a checkpoint re-saved, a version re-published).

    A folder cannot be renamed over a non-empty one, so the previous ``dst`` is first moved aside to
    ``.old-{name}-{pid}``; a kill between the two renames leaves it there for ``settle_leftover`` to
    put back. Removing it afterwards ignores errors: the new folder is already in place, and a
    leftover ``.old-`` folder is removed by the writer's next start.
    """
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.parent / f".old-{dst.name}-{os.getpid()}"
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    except OSError:
        os.replace(old, dst)  # put the previous version back before reporting the failure
        raise
    shutil.rmtree(old, ignore_errors=True)


def settle_leftover(entry: Path, kind: str, original: Path) -> None:
    """A temporary folder left by a killed writer (there is one writer, so none is in progress):
    ``.old-`` whose ``original`` is gone was moved aside by ``replace_dir`` just before the kill, and is
    put back; anything else (``.tmp-`` folders, ``.old-`` ones already replaced) is removed."""
    if kind == "old" and not original.exists():
        os.replace(entry, original)
    else:
        shutil.rmtree(entry, ignore_errors=True)
