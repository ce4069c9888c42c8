"""The decoupled launcher's torchrun master port never takes a port the run's roles will bind later."""

from __future__ import annotations

import socket

from grpo.config import load_config
from grpo.decoupled import launcher


class _ScriptedSocket:
    """socket.socket whose bind(0) hands out the next port from a script, as the kernel may."""

    def __init__(self, ports):
        self.ports = ports

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = self.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_the_master_port_skips_the_rollout_address_ref_server_and_weight_sync_ports(monkeypatch):
    cfg = load_config(None, ["train.mode=decoupled", "decoupled.trainer_ranks=2", "decoupled.address=tcp://127.0.0.1:46089",
                             "decoupled.ref_server_port=46090", "decoupled.weight_sync_port=46091"])
    assert launcher._configured_ports(cfg) == {46089, 46090, 46091}
    monkeypatch.setattr(socket, "socket", _ScriptedSocket([46089, 46090, 46091, 46092]))
    command = launcher.trainer_command(cfg, None, [])
    assert command[command.index("--master_port") + 1] == "46092"


def test_an_address_without_a_numeric_port_adds_nothing():
    cfg = load_config(None, ["decoupled.address=ipc:///tmp/grpo-rollouts"])
    assert 5555 not in launcher._configured_ports(cfg)
