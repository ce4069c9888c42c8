"""Read leases: a reader's claim on a weights version, which the writer's prune respects.

A lease is an empty file ``weights/leases/v{N}.{reader}``, created before the reader opens version N
and removed when it is done. Its mtime is its age: the writer keeps a version with a lease younger
than its ``lease_timeout_s`` and removes older leases (their reader was killed) as it goes. Only
creating a file under a name no one else uses, unlinking it and reading its mtime are used: these
behave on NFS, where ``flock`` may not, and where a file renamed over one that another host is
reading turns that host's reads stale.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from grpo.weight_store.files import _vanished
from grpo.weight_store.layout import WeightStoreError

logger = logging.getLogger(__name__)

_LEASE_FILE = re.compile(r"^v(\d+)\.[\w.-]+$")  # "v{N}.{host}-{pid}-{random}"


def _reader_name() -> str:
    """``host-pid-random``: unique across hosts and reused pids; the host and pid say whose lease it is."""
    host = re.sub(r"[^\w.-]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def read_lease(leases_dir: Path, version: int) -> Iterator[Path]:
    """Hold a lease on ``version`` (an int already checked) for the body of the with-statement.

    The caller checks that the version still exists after taking the lease: the writer may have
    pruned it just before the lease appeared.
    """
    path = leases_dir / f"v{version}.{_reader_name()}"
    try:
        leases_dir.mkdir(exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError as err:
        raise WeightStoreError(f"cannot write the read lease {path} ({err}); a reader of the weight store "
                               f"needs write access to {leases_dir}") from err
    try:
        yield path
    finally:
        _release(path)


def _release(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:  # never hide the load's own result or error: a lease left behind expires
        logger.warning("could not remove the read lease %s (%s); it pins its version until it expires", path, err)


def held_versions(leases_dir: Path, timeout_s: float) -> set[int]:
    """The versions with a lease younger than ``timeout_s`` seconds; older leases are removed (their
    reader was killed, or is slower than the writer allows)."""
    if not leases_dir.is_dir():
        return set()
    now = time.time()
    held = set()
    for entry in leases_dir.iterdir():
        if not (match := _LEASE_FILE.match(entry.name)):
            continue
        try:
            age = now - entry.stat().st_mtime
        except OSError as err:
            if _vanished(err):
                continue  # released meanwhile
            raise
        if age > timeout_s:
            entry.unlink(missing_ok=True)
        else:
            held.add(int(match.group(1)))
    return held
