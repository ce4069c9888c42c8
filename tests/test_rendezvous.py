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
    clear_trainer_finished,
    finished_run,
    is_wildcard,
    publish_trainer_address,
    publish_trainer_finished,
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



def test_a_finished_trainer_marks_its_address_for_its_own_config_only(tmp_path):
    assert finished_run(tmp_path, "abc") is None  # no file yet
    clear_trainer_finished(tmp_path)  # nothing to clear
    publish_trainer_address(tmp_path, "tcp://10.0.0.9:5555", "t1")
    assert finished_run(tmp_path, "abc") is None
    publish_trainer_finished(tmp_path, 8, "abc")
    assert finished_run(tmp_path, "abc") == 8
    assert finished_run(tmp_path, "other") is None  # e.g. the same run resumed with more steps
    assert read_trainer_address(tmp_path, timeout_s=1) == "tcp://10.0.0.9:5555"  # the address stays
    clear_trainer_finished(tmp_path)  # a trainer overwriting or resuming the folder, as it starts
    assert finished_run(tmp_path, "abc") is None
    assert json.loads((tmp_path / ADDRESS_FILE).read_text())["trainer_id"] == "t1"
    publish_trainer_finished(tmp_path, 8, "abc")
    publish_trainer_address(tmp_path, "tcp://10.0.0.9:5555", "t2")  # a trainer publishing again clears it too
    assert finished_run(tmp_path, "abc") is None
    (tmp_path / ADDRESS_FILE).write_text('{"address": "tcp://10.0.0.9:55')  # a torn read: not finished
    assert finished_run(tmp_path, "abc") is None
    publish_trainer_finished(tmp_path, 8, "abc")  # an unreadable file: a warning, the trained run does not fail
    (tmp_path / ADDRESS_FILE).unlink()
    publish_trainer_finished(tmp_path / "elsewhere", 8, "abc")
    assert not list((tmp_path / ADDRESS_FILE).parent.glob("*.tmp*"))


@pytest.mark.parametrize("wildcard", [True, False])
def test_a_sampler_that_finds_no_trainer_stops_once_the_run_is_marked_finished(tmp_path, monkeypatch, caplog,
                                                                               wildcard):
    # No trainer answers (it finished before this sampler started, or as it did): after each try the sampler
    # reads the run folder, and exits 0 once it says this config's trainer finished, where it would otherwise
    # try for decoupled.peer_timeout_s (10 minutes by default) and fail.
    from grpo.config.resolve import load_config
    from grpo.decoupled import sampler_role
    from grpo.decoupled.link_settings import config_fingerprint
    from transport_helpers import free_port

    monkeypatch.setattr(sampler_role, "RECONNECT_S", 0.3)
    gone = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "train.mode=decoupled", "decoupled.peer_timeout_s=600",
                             f"decoupled.address={'tcp://0.0.0.0:5555' if wildcard else gone}"])
    publish_trainer_address(tmp_path, gone, "t1")
    timer = threading.Timer(1.0, publish_trainer_finished, (tmp_path, 2, config_fingerprint(cfg)))
    timer.start()
    started = time.monotonic()
    with pytest.raises(sampler_role.TrainerFinished, match="finished at step 2"):
        sampler_role.connect_to_trainer(cfg, "sampler-0", "t" * 32)
    timer.join()
    assert time.monotonic() - started < 10
    assert "no trainer answers at" in caplog.text  # it tried, and logged each try
