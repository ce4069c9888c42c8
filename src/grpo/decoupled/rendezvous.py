"""Where samplers find the trainer: rank 0 writes the address it listens on into the run folder.

Under torchrun's c10d rendezvous rank 0 may land on any node, so a recipe cannot name its host. The trainer
binds every interface (``decoupled.address: tcp://0.0.0.0:5555``) and writes the address other hosts reach
(``decoupled.advertise_host``, else the host's name when it resolves to a network address) to
``<output_dir>/decoupled/trainer_address.json``; a sampler given a wildcard address reads it there (the run
folder is shared by every host already). A trainer restarted elsewhere rewrites it, and a sampler that gets
no answer at the old address reads it again. A trainer that trained its last step marks the file finished (with
its config's fingerprint): a sampler of that config that finds no trainer answering then exits instead of waiting
out the peer timeout; a resumed run with more steps is another config, and a trainer that overwrites or resumes the
folder clears the mark as it starts.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from pathlib import Path

from grpo.config import ConfigError
from grpo.decoupled.listen import WILDCARD_HOSTS

ADDRESS_FILE = Path("decoupled") / "trainer_address.json"
logger = logging.getLogger(__name__)


def split_tcp(address: str) -> tuple[str, str] | None:
    """``(host, port)`` of a ``tcp://host:port`` address; None for ipc:// and inproc://."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return None
    host, _, port = rest.rpartition(":")
    return host, port


def is_wildcard(address: str) -> bool:
    """Whether an address binds every interface (so it names no host a sampler could connect to)."""
    parts = split_tcp(address)
    return parts is not None and parts[0] in WILDCARD_HOSTS


def machine_name() -> str:
    """This machine's name: its fully qualified one, unless that is only ``localhost`` (getfqdn's answer where
    the name maps to 127.0.0.1 in /etc/hosts beside localhost), then the name the machine gives itself."""
    fqdn = socket.getfqdn()
    return socket.gethostname() if fqdn.split(".")[0] in ("localhost", "") else fqdn


def reachable_host(advertise_host: str | None) -> str:
    """The host other machines reach this one at: ``advertise_host``, else this host's name when it resolves
    to a non-loopback address. ConfigError when it cannot tell (a name mapped only to loopback)."""
    if advertise_host:
        return advertise_host
    name = machine_name()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except socket.gaierror:
        resolved = set()
    if not any(not ipaddress.ip_address(a.split("%")[0]).is_loopback for a in resolved):
        raise ConfigError(f"decoupled.address binds every interface, but this host's name {name!r} resolves "
                          f"only to {sorted(resolved) or 'nothing'}, so samplers on other hosts could not use it: "
                          "set decoupled.advertise_host to the address they reach this host at")
    return name


def advertised_address(bound: str, advertise_host: str | None) -> str:
    """The address to publish for a socket bound at ``bound`` (its real port when bound to ``:*``)."""
    host, port = split_tcp(bound) or (None, None)
    if host is None or (host not in WILDCARD_HOSTS and not advertise_host):
        return bound
    host = reachable_host(advertise_host)
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def publish_trainer_address(run_dir: str | os.PathLike, address: str, trainer_id: str) -> Path:
    """Write (atomically) where samplers reach the trainer; returns the file."""
    path = Path(run_dir) / ADDRESS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(f".tmp{os.getpid()}")
    temp.write_text(json.dumps({"address": address, "trainer_id": trainer_id, "host": socket.gethostname(),
                                "pid": os.getpid(), "time": time.time()}))
    os.replace(temp, path)
    return path


def publish_trainer_finished(run_dir: str | os.PathLike, step: int, config_hash: str) -> None:
    """Mark the published address finished: rank 0 trained up to ``step`` the run whose config hashes to
    ``config_hash`` (``grpo.decoupled.link_settings.config_fingerprint``). A file that cannot be read or written
    is a warning, not an error: the run is trained and saved, and without the mark a late sampler only waits."""
    path = Path(run_dir) / ADDRESS_FILE
    try:
        record = json.loads(path.read_text())
        record["finished"] = {"step": step, "config_hash": config_hash, "time": time.time()}
        temp = path.with_suffix(f".tmp{os.getpid()}")
        temp.write_text(json.dumps(record))
        os.replace(temp, path)
    except (OSError, ValueError, TypeError) as err:
        logger.warning("could not mark %s finished (%s): a sampler started now waits for its peer timeout", path, err)


def clear_trainer_finished(run_dir: str | os.PathLike) -> None:
    """Drop the finished mark of the run the folder held (a trainer about to overwrite or resume it), so that a
    sampler of the same config does not take the new run for the old one; nothing when there is none."""
    path = Path(run_dir) / ADDRESS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if isinstance(record, dict) and record.pop("finished", None) is not None:
        temp = path.with_suffix(f".tmp{os.getpid()}")
        temp.write_text(json.dumps(record))
        os.replace(temp, path)


def finished_run(run_dir: str | os.PathLike, config_hash: str) -> int | None:
    """The last step of the finished trainer of this config (None: no trainer of it has finished)."""
    try:
        finished = json.loads((Path(run_dir) / ADDRESS_FILE).read_text()).get("finished") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # no file yet, or a torn read on a network filesystem
    return finished.get("step") if finished.get("config_hash") == config_hash else None


def read_trainer_address(run_dir: str | os.PathLike, timeout_s: float, poll_s: float = 0.5) -> str:
    """The address trainer rank 0 published, waiting up to ``timeout_s`` for it (a sampler may start first).
    TimeoutError naming the file when none appears."""
    path = Path(run_dir) / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass  # not written yet (or a torn read on a network filesystem): look again
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no trainer address in {path} after {timeout_s:.0f} s: is the trainer running, "
                               "and is train.output_dir the same shared folder for every host?")
        time.sleep(poll_s)
