"""Sampler side of the rollout transport: ``RolloutSender`` connects a DEALER socket to the trainer and
streams batches to it. What its I/O thread does is in ``sender_io``."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from grpo.decoupled.transport.common import (
    CONTROL_MAX_BYTES,
    HWM,
    MAX_EVENTS,
    PeerClosed,
    PeerTimeout,
    TransportError,
    routing_id,
)
from grpo.decoupled.transport.curve_keys import HANDSHAKE_EVENTS, make_curve_client
from grpo.decoupled.transport.deliveries import Event
from grpo.decoupled.transport.sender_io import _Outgoing, _SenderIO
from grpo.decoupled.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    NUM_FRAMES,
    WireError,
    batch_to_message,
    encode,
)
from grpo.step.records import RolloutBatch

logger = logging.getLogger("grpo.decoupled.transport")  # the package's name: its modules log as one


class RolloutSender(_SenderIO):
    """Sampler side: connect a DEALER socket to the trainer and stream batches, at most ``max_inflight``
    unacknowledged at a time.

    ``timeout_s`` is how long the trainer may stay silent (not even answering heartbeats) before a wait
    raises PeerTimeout; a wait logs a WARNING status line every ``timeout_s / 2`` meanwhile.

    ``curve_server_key``: the trainer's CURVE public key (``curve_keys.read_server_key``), to encrypt the
    link; None: plaintext. ``curve_key_file`` names where it was read, for errors. A failed handshake (one
    side encrypting, or another key) raises TransportError at the next wait instead of a silent timeout.
    """

    def __init__(self, address: str, sampler_id: str, token: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_inflight: int = 1,
                 timeout_s: float = 60.0, *, heartbeat_s: float | None = None, config_hash: str = "",
                 curve_server_key: bytes | None = None, curve_key_file: str = ""):
        raw_id = sampler_id.encode("utf-8") if isinstance(sampler_id, str) else b""
        if not 1 <= len(raw_id) <= 200 or raw_id.startswith(b"\0"):  # the routing id adds "#incarnation"
            raise ValueError(f"sampler_id must be 1 to 200 UTF-8 bytes not starting with NUL, got {sampler_id!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.sampler_id = sampler_id
        self.config_hash = config_hash  # sent in the hello: a trainer on another config refuses this sampler
        self.token = token
        self.curve_server_key = curve_server_key
        self.curve_key_file = curve_key_file
        self._handshake_failures = 0  # in a row, since the last handshake that succeeded
        self.max_message_bytes = max_message_bytes
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(5.0, timeout_s / 4)
        self._max_frames = NUM_FRAMES
        self._max_incoming_bytes = CONTROL_MAX_BYTES
        self._cond = threading.Condition(threading.RLock())
        self._thread = None
        self._connected_once = False
        self.incarnation = 0
        self._sequence = 0
        self._unacked: OrderedDict[str, _Outgoing] = OrderedDict()
        self._trained_not_durable: OrderedDict[str, _Outgoing] = OrderedDict()  # not counted as in flight
        self.acked: list[str] = []
        self.dropped: list[tuple[str, str]] = []        # (batch_id, reason)
        self.rejected: list[tuple[str, str]] = []       # (batch_id, reason) refused by the trainer as invalid
        self.latest_weights: tuple[int, str] | None = None
        self.trainer_policy_version: int | None = None
        self.welcome: dict | None = None
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._welcomed = False
        self._bye_reason: str | None = None
        self._refusal: str | None = None                # a rejected batch, raised by the next wait
        self._last_rejection = ""                       # why the last message from the trainer was refused
        self._warned = False
        self._last_heard = time.monotonic()
        self._next_hello_at = 0.0
        self._next_heartbeat_at = 0.0
        self._work: dict | None = None                  # the trainer's last "work" answer, not taken yet
        self._next_want_at: float | None = None         # while asking for work: when to ask again

    # --- the sampler's API ----------------------------------------------------------------------

    def connect(self, incarnation: int = 0, timeout_s: float | None = None) -> dict:
        """Say hello and wait for the trainer's welcome (its header); PeerTimeout after ``timeout_s``
        (default: the sender's ``timeout_s``; a sampler may start long before its trainer)."""
        if self._connected_once:
            raise RuntimeError("connect() was called already (make a new RolloutSender to connect again)")
        self._connected_once = True
        self.incarnation = incarnation
        self._context = zmq.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.ROUTING_ID, routing_id(self.sampler_id, incarnation))
        socket.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE stays 0: with 1, ZeroMQ discards messages already received but not yet read when the
        # connection drops (a trainer's last ack or bye). What queues meanwhile reaches the next trainer,
        # which answers it as a stranger (hello_required) or as a duplicate.
        socket.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)  # the trainer sends control messages only
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.SNDHWM, HWM)
        if self.curve_server_key is not None:
            make_curve_client(socket, self.curve_server_key)
        self._monitor = socket.get_monitor_socket(HANDSHAKE_EVENTS)  # read by the I/O thread
        try:
            socket.connect(self.address)
        except zmq.ZMQError as exc:
            self._monitor.close(linger=0)
            socket.close()
            self._context.term()
            raise TransportError(f"cannot connect to {self.address}: {exc}") from exc
        with self._cond:
            self._last_heard = time.monotonic()
        self._start_io(socket, f"rollout-sender {self.sampler_id}")
        try:
            with self._cond:
                limit = self.timeout_s if timeout_s is None else timeout_s
                self._wait(lambda: self._welcomed, "connecting", None, silence_s=limit)
                return dict(self.welcome)
        except BaseException:
            self.close(bye=False)
            raise

    def send_batch(self, batch: RolloutBatch, meta: Mapping[str, Any], timeout_s: float | None = None) -> str:
        """Queue ``batch`` for the trainer, first waiting while ``max_inflight`` batches are unacked.

        ``meta`` needs ``policy_version`` (the weights the batch was sampled with); ``sampler_id``
        defaults to this sender's, ``batch_id`` to ``"{sampler_id}:{incarnation}:{n}"``. Returns the
        batch id. Raises WireError for a batch the trainer would refuse (bad shapes, too large),
        PeerTimeout when the trainer is silent for ``timeout_s`` of the sender (or the wait exceeds the
        ``timeout_s`` given here), PeerClosed when the trainer said bye.
        """
        self._require_connected()
        meta = dict(meta)
        if meta.setdefault("sampler_id", self.sampler_id) != self.sampler_id:
            raise ValueError(f"meta sampler_id {meta['sampler_id']!r} is not this sender's {self.sampler_id!r}")
        if "batch_id" not in meta:
            with self._cond:
                meta["batch_id"] = f"{self.sampler_id}:{self.incarnation}:{self._sequence}"
                self._sequence += 1
        header, tensors = batch_to_message(batch, meta)
        frames = encode("batch", header, tensors, token=self.token)
        size = sum(len(f) for f in frames)
        with self._cond:
            limit = min(self.max_message_bytes, (self.welcome or {}).get("max_message_bytes", self.max_message_bytes))
            if size > limit:
                raise WireError(f"batch {meta['batch_id']} is {size} bytes, over the limit of {limit} bytes "
                                f"(max_message_bytes of this sender and of the trainer)")
            if meta["batch_id"] in self._unacked or meta["batch_id"] in self._trained_not_durable:
                raise ValueError(f"batch {meta['batch_id']!r} is already waiting for its ack")
            self._wait(lambda: len(self._unacked) < self.max_inflight, f"sending batch {meta['batch_id']}",
                       timeout_s)
            self._unacked[meta["batch_id"]] = _Outgoing(frames, next_send_at=0.0)
        self._wakeup.set()
        return meta["batch_id"]

    def resend_unacked(self) -> int:
        """Send every unacked batch again now (the trainer ignores those it holds); returns how many."""
        self._require_connected()
        with self._cond:
            for outgoing in self._unacked.values():
                outgoing.next_send_at = 0.0
            count = len(self._unacked)
        self._wakeup.set()
        return count

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """The events since the last poll, waiting up to ``timeout_s`` for one when there are none.

        With no event to return, raises PeerClosed once the trainer said bye (the bye event itself is
        returned first) and PeerTimeout when it has been silent for the sender's ``timeout_s``, so a loop
        of polls cannot spin forever on a trainer that is gone.
        """
        self._require_connected()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._events:
                self._raise_if_failed()
                if self._bye_reason is not None:
                    raise PeerClosed(f"trainer at {self.address} said bye ({self._bye_reason})")
                now = time.monotonic()
                if now - self._last_heard >= self.timeout_s:
                    raise PeerTimeout(f"trainer at {self.address} silent for {now - self._last_heard:.1f} s")
                if now >= deadline:
                    break
                self._cond.wait(min(deadline - now, 0.25))
            events = list(self._events)
            self._events.clear()
            return events

    def request_work(self, timeout_s: float | None = None) -> dict:
        """Ask the trainer for a chunk to make and wait for its answer: ``{batch_id, step, rank,
        min_version}`` (a ``grpo.decoupled.work_plan.Assignment`` header). The question is repeated every
        second until answered, so a lost message or a restarted trainer only delays it."""
        self._require_connected()
        with self._cond:
            self._work, self._next_want_at = None, 0.0
        self._wakeup.set()
        with self._cond:
            try:
                self._wait(lambda: self._work is not None, "waiting for work", timeout_s)
            finally:
                self._next_want_at = None
            work, self._work = self._work, None
            return work

    def wait_for_weights(self, min_version: int, timeout_s: float | None = None) -> tuple[int, str]:
        """The latest announced weights once their version is >= ``min_version``: (version, path)."""
        self._require_connected()
        with self._cond:
            self._wait(lambda: self.latest_weights is not None and self.latest_weights[0] >= min_version,
                       f"waiting for weights version >= {min_version}", timeout_s)
            return self.latest_weights

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every sent batch is acked or dropped."""
        self._require_connected()
        with self._cond:
            self._wait(lambda: not self._unacked and not self._trained_not_durable, "waiting for the last acks",
                       timeout_s)

    @property
    def inflight(self) -> int:
        """Batches sent (or queued to send) and not yet acked or dropped."""
        with self._cond:
            return len(self._unacked)

    @property
    def unacked_ids(self) -> list[str]:
        with self._cond:
            return list(self._unacked)

    @property
    def seconds_since_heard(self) -> float:
        """Seconds since the last valid message from the trainer."""
        with self._cond:
            return time.monotonic() - self._last_heard

    def close(self, bye: bool = True) -> None:
        """Say bye (optional, 0.5 s linger) and close; unacked batches are forgotten."""
        if self._thread is None:
            return
        if bye and self._thread.is_alive():
            self._submit(lambda: self._send_now(encode("bye", {"reason": "sampler closing"}, token=self.token)))
        self._stop_io(linger_ms=500 if bye else 0)

    def __enter__(self) -> RolloutSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _require_connected(self) -> None:
        if not self._connected_once:
            raise RuntimeError("call connect() first")
        self._check_open()

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float | None,
              silence_s: float | None = None) -> None:
        """Wait (lock held) until ``ready()``. Logs a status line every ``silence_s / 2``; raises
        PeerTimeout when the trainer is silent for ``silence_s`` (default ``self.timeout_s``) or
        ``timeout_s`` passes, PeerClosed after the trainer's bye."""
        silence_s = self.timeout_s if silence_s is None else silence_s
        start = time.monotonic()
        status_every = silence_s / 2
        next_status = start + status_every
        while True:
            self._raise_if_failed()
            if self._refusal is not None:  # a batch sent earlier was refused: say so (once) at the next wait
                refusal, self._refusal = self._refusal, None
                raise TransportError(refusal)
            if ready():
                return
            if self._bye_reason is not None:
                raise PeerClosed(f"trainer at {self.address} said bye ({self._bye_reason}) while {what}")
            now = time.monotonic()
            silent = now - self._last_heard
            # A wait gives the trainer timeout_s from its start even when it was silent before (e.g. it
            # restarted while this sampler generated).
            if now - max(self._last_heard, start) >= silence_s:
                hint = f"; its last message was refused: {self._last_rejection}" if self._last_rejection else ""
                if self.welcome is None:
                    raise PeerTimeout(f"no trainer at {self.address} after {silent:.1f} s{hint}")
                raise PeerTimeout(f"trainer at {self.address} silent for {silent:.1f} s while {what}{hint}")
            if timeout_s is not None and now - start >= timeout_s:
                raise PeerTimeout(f"{what}: gave up after {timeout_s:.1f} s (trainer at {self.address} "
                                  f"last heard {silent:.1f} s ago)")
            if now >= next_status:
                logger.warning("waiting for trainer at %s for %.0f s (%s; %d/%d batches unacked; "
                               "last heard from it %.0f s ago)", self.address, now - start, what,
                               len(self._unacked), self.max_inflight, silent)
                next_status += status_every
            self._cond.wait(min(0.25, max(0.01, next_status - now)))
