"""Constants, errors and checks shared by both ends of the rollout transport."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
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
    hidden = hidden_loopback(host)
    if hidden:
        raise ValueError(f"listening on {address}: {host!r} resolves only to loopback ({', '.join(hidden)}), so "
                         "peers on other machines could never connect (an /etc/hosts entry mapping the host name "
                         "to 127.0.1.1 does this); bind the machine's network address, or * / 0.0.0.0 for all")


WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})


def hidden_loopback(host: str) -> list[str]:
    """The loopback addresses a host *name* resolves to when it resolves to nothing else ([] for loopback
    spelled as such, wildcards, or a name with a reachable address): a name that means "this machine's
    address to the others" but binds where no other machine reaches. ValueError when it does not resolve."""
    if host in LOOPBACK_HOSTS or host in WILDCARD_HOSTS:
        return []
    try:
        ipaddress.ip_address(host.strip("[]"))
        return []  # a literal address means what it says
    except ValueError:
        pass
    try:
        resolved = sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except socket.gaierror as err:
        raise ValueError(f"host {host!r} does not resolve: {err.strerror}") from None
    return resolved if all(ipaddress.ip_address(a).is_loopback for a in resolved) else []


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
