"""Constants, errors and checks shared by both ends of the rollout transport."""

from __future__ import annotations

from typing import Any

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
HWM = 1000                      # messages queued per peer and direction before sends fail / reads stop
POLL_MS = 100                   # longest sleep of an I/O thread (it also wakes on commands and messages)
MAX_MESSAGES_PER_WAKE = 64      # an I/O thread then runs its commands and timers again
MAX_WARNED_PEERS = 4096         # bound on the "already warned about this peer" memory
BUSY_BACKOFF_S = (0.1, 2.0)     # first and longest wait before a sampler resends a batch refused as busy
MAX_EVENTS = 10_000             # events kept for poll(); the oldest go first (state is kept separately)
# What a sampler accepts from the trainer: control messages only (the longest is an error reason, cut at
# 500 characters, or a weights path), so far less than a batch.
CONTROL_MAX_BYTES = 1024 * 1024


class TransportError(RuntimeError):
    """The transport cannot go on (its I/O thread failed, a peer refused a batch, a socket cannot bind)."""


class PeerTimeout(TransportError, TimeoutError):
    """The other side did not answer in time."""


class PeerClosed(TransportError):
    """The trainer said bye while this sampler was waiting for it."""


def check_bind_address(address: str, token: str) -> None:
    """Refuse a listening address beyond this machine without a token (anyone there could send batches)."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise ValueError(f"address {address!r} must look like tcp://127.0.0.1:5555 (or ipc://, inproc://)")
    if scheme != "tcp":
        return
    host = rest.rsplit(":", 1)[0]
    if host not in LOOPBACK_HOSTS and not token:
        raise ValueError(f"listening on {address} reaches beyond this machine: set a shared token "
                         f"(or bind tcp://127.0.0.1:PORT)")


def _check_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"a policy version is an int, got {version!r}")


def _label(identity: bytes) -> str:
    """A routing id as text for logs: the sampler id, or hex for ZeroMQ's generated ids."""
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + identity.hex()
    return text if text.isprintable() and text else "0x" + identity.hex()
