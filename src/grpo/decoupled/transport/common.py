"""Constants, errors and checks shared by both ends of the rollout transport."""

from __future__ import annotations

from typing import Any

HWM = 1000                      # messages queued per peer and direction before sends fail / reads stop
POLL_MS = 100                   # longest sleep of an I/O thread (it also wakes on commands and messages)
MAX_MESSAGES_PER_WAKE = 64      # an I/O thread then runs its commands and timers again
LOST_AFTER_S = 30.0             # a sampler silent this long (it heartbeats every <= 5 s) loses its chunk
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




def routing_id(sampler_id: str, incarnation: int) -> bytes:
    """A sampler process's ZeroMQ routing id: its sampler id and incarnation, so a restarted sampler and a
    second process started with the same index are told apart (the trainer refuses the older one)."""
    return f"{sampler_id}#{incarnation}".encode()


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
