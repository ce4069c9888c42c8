"""The weight broadcast (grpo.weight_store.broadcast): rank 0 in the test process, receivers in spawned
processes on 127.0.0.1. What arrives is bit for bit what the file store gives; a receiver killed makes
rank 0's next send raise instead of hang."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time

import pytest
import safetensors.torch
import torch
from transport_helpers import free_port

from grpo.weight_store import WeightStore
from grpo.weight_store.broadcast import (
    BroadcastError,
    WeightBroadcast,
    pack_buckets,
    unpack_buckets,
)

TIMEOUT_S = 60.0  # a bound against hangs only; no assertion reads a time


def receive_into_files(port: int, rank: int, size: int, out_dir: str, token: str | None = None,
                       join_timeout_s: float = TIMEOUT_S) -> None:
    """A receiver: every version it gets goes to ``out_dir/rank{rank}-v{version}.safetensors`` (written
    to a temporary name first, so the test sees only whole files); exits when rank 0 closes the group."""
    group = WeightBroadcast("127.0.0.1", port, rank, size, join_timeout_s=join_timeout_s, op_timeout_s=TIMEOUT_S,
                            token=token)
    while (received := group.receive()) is not None:
        version, state = received
        path = os.path.join(out_dir, f"rank{rank}-v{version}.safetensors")
        safetensors.torch.save_file(state, path + ".tmp")
        os.replace(path + ".tmp", path)


def start_receivers(tmp_path, size: int) -> tuple[int, list]:
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    receivers = [spawn.Process(target=receive_into_files, args=(port, rank, size, str(tmp_path)), daemon=True)
                 for rank in range(1, size)]
    for process in receivers:
        process.start()
    return port, receivers


def wait_for_file(path, process) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert process.is_alive(), f"receiver exited with {process.exitcode} before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)


@functools.cache  # building the model dominates; nothing mutates the state
def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    from grpo.models.tiny import build_qwen2, build_tokenizer
    from grpo.weight_store import state_dict_for_publish

    model = build_qwen2(build_tokenizer(), hidden_size=64, num_layers=2, seed=0)
    with torch.no_grad():  # a different version: every weight moved
        generator = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.01)
    return state_dict_for_publish(model)[0]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_pack_and_unpack_keep_every_dtype_and_shape_in_small_buckets():
    state = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(2.5),
             "i64": torch.arange(4), "flag": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3)}
    header, buckets = pack_buckets(state, bucket_bytes=16)  # small buckets: most tensors alone, odd offsets
    assert len(buckets) > 1 and sum(b.numel() for b in buckets) == sum(e[3] for e in header["tensors"])
    assert_same(unpack_buckets(header, buckets), state)


def test_two_receivers_get_two_versions_bit_for_bit_as_the_file_store_gives_them(tmp_path):
    port, receivers = start_receivers(tmp_path, size=3)
    group = WeightBroadcast("127.0.0.1", port, 0, 3, join_timeout_s=TIMEOUT_S, op_timeout_s=TIMEOUT_S)
    store = WeightStore(tmp_path / "run")
    try:
        for version, seed in ((1, 1), (2, 2)):
            state = tiny_state(seed)
            group.send(version, state)
            store.publish(version, state, kind="full")
            from_files = store.load(version).state_dict
            for rank, process in enumerate(receivers, start=1):
                path = tmp_path / f"rank{rank}-v{version}.safetensors"
                wait_for_file(path, process)
                assert_same(safetensors.torch.load_file(path), from_files)
        first = next(iter(state))
        assert not torch.equal(store.load(1).state_dict[first], store.load(2).state_dict[first])  # two versions
    finally:
        group.close()
    for process in receivers:
        process.join(TIMEOUT_S)
        assert process.exitcode == 0  # the close ends their loop


def test_a_group_whose_members_never_join_fails_within_the_join_bound():
    with pytest.raises(BroadcastError, match="did not form"):
        WeightBroadcast("127.0.0.1", free_port(), 0, 2, join_timeout_s=1.0, op_timeout_s=1.0)


def test_a_killed_receiver_makes_the_next_send_raise_and_the_publisher_fall_back_to_files(tmp_path, caplog):
    # grpo.decoupled.weight_sync: version 1 goes by broadcast (and to files behind it); a receiver killed
    # makes version 2's send raise BroadcastError (gloo sees the reset connection, no timeout is waited
    # out), so version 2 and every later one go to files only, announced with their file paths.
    from grpo.decoupled.weight_sync import BroadcastPublisher, is_broadcast

    port, receivers = start_receivers(tmp_path, size=3)
    store = WeightStore(tmp_path / "run")
    publisher = BroadcastPublisher(store, 3, lambda: WeightBroadcast(
        "127.0.0.1", port, 0, 3, join_timeout_s=TIMEOUT_S, op_timeout_s=TIMEOUT_S), form_timeout_s=TIMEOUT_S)
    try:
        assert is_broadcast(publisher.publish(1, tiny_state(1)))
        for rank, process in enumerate(receivers, start=1):
            wait_for_file(tmp_path / f"rank{rank}-v1.safetensors", process)
        os.kill(receivers[1].pid, signal.SIGKILL)
        receivers[1].join(TIMEOUT_S)
        for version in (2, 3):
            path = publisher.publish(version, tiny_state(version))
            assert not is_broadcast(path) and path == str(store.version_dir(version))
        failures = [r.getMessage() for r in caplog.records if "weight broadcast failed" in r.getMessage()]
        assert len(failures) == 1 and "BroadcastError" not in failures[0] and "rank 0 of 3" in failures[0]
        assert store.versions() == [1, 2, 3]  # version 1's files were written behind its broadcast
        assert_same(store.load(3).state_dict, tiny_state(3))
    finally:
        publisher.close()
        receivers[0].kill()
        receivers[0].join(TIMEOUT_S)


def test_the_publisher_uses_files_when_the_group_does_not_form(tmp_path):
    from grpo.decoupled.weight_sync import BroadcastPublisher, ReceivedWeights

    store = WeightStore(tmp_path / "run")
    port = free_port()
    publisher = BroadcastPublisher(store, 3, lambda: WeightBroadcast(
        "127.0.0.1", port, 0, 2, join_timeout_s=1.0, op_timeout_s=1.0), form_timeout_s=TIMEOUT_S)
    assert publisher.publish(1, tiny_state(1)) == str(store.version_dir(1))
    publisher.close()
    # A sampler that is not (yet) a member loads from files: it is never kept waiting for the group.
    not_joined = ReceivedWeights(lambda: WeightBroadcast("127.0.0.1", free_port(), 1, 2, join_timeout_s=TIMEOUT_S,
                                                         op_timeout_s=TIMEOUT_S))
    assert not_joined.newest(1, timeout_s=TIMEOUT_S) is None


@pytest.mark.slow
def test_a_member_without_the_runs_token_gets_nothing_and_one_with_it_gets_the_weights(tmp_path):
    # The group's keys in the store derive from the token: a process that reaches the port without it finds no
    # member, is given no rank, and its join times out with nothing received; the real sampler then joins.
    import threading

    port, spawn, token = free_port(), multiprocessing.get_context("spawn"), "t" * 32
    formed: list = []
    sender = threading.Thread(target=lambda: formed.append(WeightBroadcast(
        "127.0.0.1", port, 0, 2, join_timeout_s=TIMEOUT_S, op_timeout_s=TIMEOUT_S, token=token)), daemon=True)
    sender.start()
    for intruder_token in (None, "x" * 32):
        intruder = spawn.Process(target=receive_into_files, args=(port, 1, 2, str(tmp_path), intruder_token, 3.0))
        intruder.start()
        intruder.join(TIMEOUT_S)
        assert intruder.exitcode not in (0, None), "an intruder joined the weights group"
        assert not formed and not list(tmp_path.glob("*.safetensors"))
    member = spawn.Process(target=receive_into_files, args=(port, 1, 2, str(tmp_path), token), daemon=True)
    member.start()
    sender.join(TIMEOUT_S)
    group = formed[0]
    try:
        group.send(1, tiny_state(1))
        wait_for_file(tmp_path / "rank1-v1.safetensors", member)
        assert_same(safetensors.torch.load_file(tmp_path / "rank1-v1.safetensors"), tiny_state(1))
    finally:
        group.close()
    member.join(TIMEOUT_S)
    assert member.exitcode == 0


def test_without_a_token_the_store_listens_on_loopback_only():
    # No token means no authentication: rank 0's store then takes connections from this machine only.
    import threading

    port = free_port()

    def rank_0() -> None:
        with pytest.raises(BroadcastError, match="did not form"):  # nobody joins
            WeightBroadcast("127.0.0.1", port, 0, 2, join_timeout_s=5.0, op_timeout_s=5.0)

    alone = threading.Thread(target=rank_0, daemon=True)
    alone.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not (listening := _listeners(port)):
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.05)
    assert listening == {"127.0.0.1"}, listening
    alone.join(TIMEOUT_S)


def _listeners(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (IPv4 and IPv6), from /proc/net/tcp*."""
    import ipaddress

    found = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(raw)))
    return found
