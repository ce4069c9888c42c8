"""Trainer rank 0's address in the run folder (grpo.decoupled.rendezvous)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from grpo.config import ConfigError
from grpo.decoupled.rendezvous import (
    ADDRESS_FILE,
    advertised_address,
    is_wildcard,
    publish_trainer_address,
    read_trainer_address,
)


def test_wildcards_name_no_host():
    assert is_wildcard("tcp://0.0.0.0:5555") and is_wildcard("tcp://*:5555")
    assert not is_wildcard("tcp://10.0.0.2:5555") and not is_wildcard("ipc:///tmp/x")


def test_the_published_address_names_a_host_others_reach(monkeypatch):
    assert advertised_address("tcp://0.0.0.0:41234", "10.7.0.1") == "tcp://10.7.0.1:41234"
    assert advertised_address("tcp://10.0.0.2:5555", None) == "tcp://10.0.0.2:5555"
    assert advertised_address("tcp://0.0.0.0:5", "fd00::1") == "tcp://[fd00::1]:5"
    # a host name that resolves to a network address is published as such
    monkeypatch.setattr(socket, "getfqdn", lambda: "node7.cluster")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("10.1.2.3", 0))])
    assert advertised_address("tcp://0.0.0.0:5555", None) == "tcp://node7.cluster:5555"


def test_a_name_mapped_only_to_loopback_is_a_config_error(monkeypatch):
    monkeypatch.setattr(socket, "getfqdn", lambda: "laptop")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0))])
    with pytest.raises(ConfigError, match=r"'laptop' resolves only to \['127.0.1.1'\].*decoupled.advertise_host"):
        advertised_address("tcp://0.0.0.0:5555", None)


def test_the_loopback_refusal_names_the_machine_where_getfqdn_says_localhost(monkeypatch):
    # /etc/hosts with "127.0.0.1 localhost vm": getfqdn() answers "localhost", which names no machine.
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.0.1", 0))])
    with pytest.raises(ConfigError, match=r"this host's name 'vm' resolves only to \['127.0.0.1'\]"):
        advertised_address("tcp://0.0.0.0:5555", None)


def test_a_sampler_waits_for_the_address_and_reads_it(tmp_path):
    def later():
        time.sleep(0.3)
        publish_trainer_address(tmp_path, "tcp://10.0.0.9:5555", "abc")

    thread = threading.Thread(target=later)
    thread.start()
    assert read_trainer_address(tmp_path, timeout_s=10, poll_s=0.05) == "tcp://10.0.0.9:5555"
    thread.join()
    record = json.loads((tmp_path / ADDRESS_FILE).read_text())
    assert record["trainer_id"] == "abc" and record["pid"] > 0
    assert not list((tmp_path / ADDRESS_FILE).parent.glob("*.tmp*")), "written atomically, no leftovers"


def test_no_address_is_a_timeout_naming_the_file(tmp_path):
    with pytest.raises(TimeoutError, match=r"trainer_address.json after 0 s.*same shared folder"):
        read_trainer_address(tmp_path, timeout_s=0.1, poll_s=0.05)
