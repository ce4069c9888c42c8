"""Who may listen where, checked before any role starts: a listening address beyond this machine needs the shared
token, and a host name that resolves only to loopback is refused. Only the standard library and grpo.config, so that
the decoupled launcher checks a recipe without loading the transport (torch, transformers: seconds)."""

from __future__ import annotations

import ipaddress
import os
import socket

from grpo.config import ConfigError, RunConfig

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})


def shared_token(cfg: RunConfig) -> str:
    """The token from ``decoupled.token_env`` ("" when none is configured)."""
    name = cfg.decoupled.token_env
    if not name:
        return ""
    token = os.environ.get(name, "")
    if not token:
        raise ConfigError(f"decoupled.token_env: environment variable {name} is empty or not set")
    return token


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
