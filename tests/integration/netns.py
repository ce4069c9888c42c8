"""Several "hosts" on one machine: Linux network namespaces on a bridge, each with its own address and no
route to the others but through the bridge, so a process that quietly relies on loopback to reach a peer
fails here as it would across machines. Needs root and iproute2; ``hosts`` skips the test otherwise."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.77"  # 10.77.<net>.<host>/24: private, and only on the interfaces these helpers create
# Each hosts() call names its links afresh: a namespace deleted while a killed process still holds it lingers with its
# veth for a moment, and a next call reusing the names then failed with "File exists" (seen on a loaded machine).
_CALLS = itertools.count(1)


@dataclass(frozen=True)
class Host:
    """One network namespace: its name, address and interface (GLOO_SOCKET_IFNAME for torch.distributed)."""

    name: str
    address: str
    interface: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def resolve_as(self, lines: str) -> None:
        """This host's /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts over it), e.g. a name mapped
        to 127.0.1.1 as Debian's installer does."""
        folder = Path("/etc/netns") / self.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(lines)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Every process of this host (``kill -9`` of a machine, as far as its processes go)."""
        result = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        for pid in result.stdout.split():
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _can_make_namespaces() -> str:
    """Why this machine cannot run the tests ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return ""


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts on a fresh bridge (10.77.N.1 .. 10.77.N.count); all removed afterwards."""
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"g{os.getpid() % 100000}c{next(_CALLS) % 100}"  # at most 15 characters with the f"v{tag}h{i}" around it
    net = os.getpid() % 250 + 1
    bridge = f"br{tag}"
    made: list[Host] = []
    try:
        try:
            _run("ip", "link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as err:
            pytest.skip(f"cannot create a bridge: {err.stderr.strip()}")
        _run("ip", "link", "set", bridge, "up")
        for i in range(1, count + 1):
            host = Host(f"{tag}h{i}", f"{SUBNET}.{net}.{i}", f"v{tag}h{i}")
            _run("ip", "netns", "add", host.name)
            made.append(host)
            outside = _outside(host)
            _run("ip", "link", "add", host.interface, "type", "veth", "peer", "name", outside)
            _run("ip", "link", "set", outside, "master", bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "link", "set", host.interface, "netns", host.name)
            _run(*host.command(["ip", "addr", "add", f"{host.address}/24", "dev", host.interface]))
            _run(*host.command(["ip", "link", "set", host.interface, "up"]))
            _run(*host.command(["ip", "link", "set", "lo", "up"]))
        yield made
    finally:
        for host in made:
            host.kill_all()
            # Deleting the outside end removes the pair now; the namespace itself goes once its processes are reaped.
            subprocess.run(["ip", "link", "del", _outside(host)], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / host.name, ignore_errors=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _outside(host: Host) -> str:
    """The bridge-side end of ``host``'s veth pair."""
    return "o" + host.interface[1:]
