"""Helpers shared by the grpo.decoupled.transport tests (test_transport*.py): a small batch, a sender with short
timeouts, a trainer thread, a bare ZeroMQ DEALER, bounded waits and a free port.

Every wait is bounded by ``WAIT``; a helper thread that fails reports its exception to the test."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from contextlib import contextmanager

import torch
import zmq

from grpo.decoupled.transport import RolloutReceiver, RolloutSender
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

ANY_PORT = "tcp://127.0.0.1:*"
WAIT = 10.0  # upper bound of any wait that should finish in milliseconds


def make_batch(N: int = 4, G: int = 2, Lc: int = 5, value: float = 0.0) -> RolloutBatch:
    return RolloutBatch(
        generation=Generation(
            prompt_ids=torch.arange(N * 3).view(N, 3), prompt_mask=torch.ones(N, 3, dtype=torch.long),
            completion_ids=torch.arange(N * Lc).view(N, Lc), completion_mask=torch.ones(N, Lc, dtype=torch.long),
            truncated=torch.zeros(N, dtype=torch.bool), completions=[f"c{i}" for i in range(N)]),
        rewards=torch.full((N,), float(value)), reward_parts=torch.full((N, 1), float(value)), reward_names=["r"],
        advantages=torch.zeros(N), old_logprobs=None, ref_logprobs=None, prompts=["p"] * (N // G),
        columns={"answer": ["1"] * N})


def sender(address: str, sampler_id: str = "s0", **kwargs) -> RolloutSender:
    kwargs = {"timeout_s": 5.0, "heartbeat_s": 0.1, **kwargs}
    return RolloutSender(address, sampler_id, **kwargs)


class Trainer(threading.Thread):
    """Takes ``count`` batches from a receiver, checks the queue bound, and acks each after ``delay_s``."""

    def __init__(self, receiver: RolloutReceiver, count: int, delay_s: float = 0.0, on_batch=None):
        super().__init__(daemon=True)
        self.receiver, self.count, self.delay_s, self.on_batch = receiver, count, delay_s, on_batch
        self.items, self.error, self.max_depth = [], None, 0

    def run(self) -> None:
        try:
            for _ in range(self.count):
                item = self.receiver.next_batch(timeout_s=WAIT)
                assert item is not None, "no batch within the wait"
                self.max_depth = max(self.max_depth, self.receiver.stats["queue_depth"])
                self.items.append(item)
                time.sleep(self.delay_s)
                if self.on_batch is None or self.on_batch(item):
                    self.receiver.ack(item.batch_id, policy_version=len(self.items))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test's thread by finish())
            self.error = exc

    def finish(self) -> list:
        self.join(timeout=WAIT)
        assert not self.is_alive(), "trainer thread did not finish"
        if self.error is not None:
            raise self.error
        return self.items


@contextmanager
def raw_dealer(address: str, identity: bytes | None = None):
    """A bare ZeroMQ DEALER, to send what no RolloutSender would."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


def wait_until(condition, what: str, timeout_s: float = WAIT) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range.

    A port from bind(("", 0)) is ephemeral: between this call and the process that listens on it, the kernel may give
    the same number to an outgoing connection or to another bind(0) (torchrun's master port), and the listener fails
    with "Address already in use" (seen in CI). Ports below the range are only ever taken by explicit binds."""
    low, _ = _ephemeral_range()
    # Under pytest-xdist (`make test` runs two workers) each worker draws from its own residue class, so two
    # workers never hand out the same port before its listener binds it.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    candidates = [p for p in range(max(1024, low - 12000), low) if p % workers == worker % workers]
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        if port in _HANDED_OUT:
            continue
        try:
            for host in ("127.0.0.1", "0.0.0.0"):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port below the ephemeral range starting at {low}")
