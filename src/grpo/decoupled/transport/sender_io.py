"""The sampler side's I/O thread: hello until welcomed, heartbeats, (re)sends of unacked batches, the
trainer's answers (the conversation is described in ``grpo.decoupled.transport``), and failed handshakes."""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from grpo.decoupled.transport.common import BUSY_BACKOFF_S, CONTROL_MAX_BYTES, POLL_MS
from grpo.decoupled.transport.curve_keys import CLOSED_HANDSHAKES_TO_FAIL, handshake_failure
from grpo.decoupled.transport.deliveries import Event
from grpo.decoupled.transport.io_thread import _IOThread
from grpo.decoupled.wire import WireError, decode, encode

logger = logging.getLogger("grpo.decoupled.transport")  # the package's name: its modules log as one


@dataclass
class _Outgoing:
    frames: list[bytes]
    next_send_at: float | None  # monotonic time of the next (re)send; None once sent
    busy_count: int = 0


class _SenderIO(_IOThread):
    """What ``RolloutSender``'s I/O thread does: hello until welcomed, heartbeats, (re)sends of unacked
    batches, and what each message from the trainer changes."""

    # set up by RolloutSender.__init__
    address: str
    sampler_id: str
    token: str
    curve_server_key: bytes | None
    curve_key_file: str
    _monitor: zmq.Socket  # the socket's monitor: handshake events (curve_keys.HANDSHAKE_EVENTS)
    _handshake_failures: int
    max_message_bytes: int
    heartbeat_s: float
    incarnation: int
    acked: list[str]
    dropped: list[tuple[str, str]]
    rejected: list[tuple[str, str]]
    latest_weights: tuple[int, str] | None
    trainer_policy_version: int | None
    welcome: dict | None
    _unacked: OrderedDict[str, _Outgoing]
    _trained_not_durable: OrderedDict[str, _Outgoing]  # acked with durable false: kept to resend after a restart
    _events: deque[Event]
    _welcomed: bool
    _bye_reason: str | None
    _refusal: str | None
    _last_rejection: str
    _warned: bool
    _last_heard: float
    _next_hello_at: float
    _next_heartbeat_at: float
    _work: dict | None
    _next_want_at: float | None

    def _send_now(self, frames: list[bytes]) -> bool:
        """Send without blocking (I/O thread); False when the outgoing queue is full (HWM messages)."""
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _poll_ms(self) -> int:
        with self._cond:
            times = [self._next_heartbeat_at if self._welcomed else self._next_hello_at]
            if self._welcomed and self._next_want_at is not None:
                times.append(self._next_want_at)
            times += [o.next_send_at for o in self._unacked.values() if o.next_send_at is not None]
        wait_s = min(times) - time.monotonic()
        return max(0, min(POLL_MS, int(wait_s * 1000) + 1))

    def _on_timer(self, now: float) -> None:
        self._check_handshakes()
        with self._cond:
            if not self._welcomed:
                if now >= self._next_hello_at:
                    fields = {"sampler_id": self.sampler_id, "incarnation": self.incarnation,
                              "host": socket.gethostname()}
                    hello = encode("hello", {**fields, **({"config_hash": self.config_hash} if self.config_hash
                                                          else {})}, token=self.token)
                    # A sent hello may still be lost (a trainer restarting): ask again after a while.
                    sent = self._send_now(hello)
                    self._next_hello_at = now + (min(1.0, self.heartbeat_s) if sent else 0.05)
                return
            for outgoing in self._unacked.values():
                if outgoing.next_send_at is not None and outgoing.next_send_at <= now:
                    if not self._send_now(outgoing.frames):
                        outgoing.next_send_at = now + 0.05
                        break
                    outgoing.next_send_at = None
            if now >= self._next_heartbeat_at:
                self._send_now(encode("heartbeat", {"time": time.time()}, token=self.token))
                self._next_heartbeat_at = now + self.heartbeat_s
            if self._next_want_at is not None and now >= self._next_want_at:
                sent = self._send_now(encode("want", {}, token=self.token))
                self._next_want_at = now + (1.0 if sent else 0.05)

    def _check_handshakes(self) -> None:
        """Read the socket monitor's handshake events: a failure becomes the next wait's TransportError.

        The monitor is not in the I/O thread's poller: reading it at every wake (at most ``POLL_MS``
        apart) is soon enough for an error that would otherwise wait for the peer timeout.
        """
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_failures = 0
                continue
            self._handshake_failures += 1
            if (event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    and self._handshake_failures < CLOSED_HANDSHAKES_TO_FAIL):
                continue  # maybe a trainer that died mid-handshake: only a repeat is a refusal
            reason = handshake_failure(event["event"], event["value"], self.address,
                                       self.curve_server_key is not None, self.curve_key_file)
            with self._cond:
                log = logger.debug if self._refusal == reason else logger.error  # a repeat not yet raised: quiet
                log("sampler %s: %s", self.sampler_id, reason)
                self._refusal = reason
                self._cond.notify_all()

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        super()._close_sockets()

    def _on_frames(self, frames: list[bytes], problem: str) -> None:
        try:
            if problem:
                raise WireError(problem)
            message = decode(frames, token=self.token, max_bytes=CONTROL_MAX_BYTES)
        except WireError as exc:
            self._last_rejection = str(exc)
            log = logger.debug if self._warned else logger.warning
            self._warned = True
            log("sampler %s refused a message from the trainer at %s: %s", self.sampler_id, self.address, exc)
            return
        kind, header = message.kind, message.header
        with self._cond:
            self._last_heard = time.monotonic()
            self._last_rejection = ""
            handler = {"welcome": self._on_welcome, "ack": self._on_ack, "dropped": self._on_dropped,
                       "busy": self._on_busy, "weights": self._on_weights, "heartbeat": self._on_heartbeat,
                       "work": self._on_work,
                       "bye": self._on_bye, "error": self._on_error}.get(kind)
            if handler is None:
                logger.warning("sampler %s ignored an unexpected %s message from the trainer", self.sampler_id, kind)
                return
            handler(header)
            if kind != "heartbeat":
                self._events.append(Event(kind, header))
            self._cond.notify_all()

    def _on_welcome(self, header: dict) -> None:
        if self.welcome is not None and self.welcome["trainer_id"] != header["trainer_id"]:
            logger.info("trainer at %s restarted (trainer id %s -> %s)", self.address,
                        self.welcome["trainer_id"], header["trainer_id"])
        self.welcome = header
        self.trainer_policy_version = header["policy_version"]
        self._bye_reason = None
        if header.get("weights_path") is not None:
            self.latest_weights = (header["policy_version"], header["weights_path"])
        if not self._welcomed:
            self._welcomed = True
            self._next_heartbeat_at = time.monotonic() + self.heartbeat_s
            # A restarted trainer may accept less than the one the batches were checked against. Never
            # send it an oversized frame: ZeroMQ would cut the connection (and libzmq 4.3.5 can abort the
            # sending process when that happens mid-message).
            limit = min(self.max_message_bytes, header["max_message_bytes"])
            for batch_id, outgoing in list(self._unacked.items()):
                size = sum(len(f) for f in outgoing.frames)
                if size > limit:
                    del self._unacked[batch_id]
                    reason = f"{size} bytes, over the trainer's limit of {limit} bytes"
                    self.rejected.append((batch_id, reason))
                    self._refusal = f"cannot resend batch {batch_id} to the trainer at {self.address}: {reason}"
                    logger.error("%s", self._refusal)
            # Batches trained but in no checkpoint: a restarted trainer may have lost them (it trains them
            # again) or have them in its checkpoint (it acknowledges them); either way they go again.
            # They go first: they are older than anything still unacked, and a trainer that resumes from
            # its checkpoint needs them in their original order (a later batch first would make them stale).
            pending = list(self._trained_not_durable.items()) + list(self._unacked.items())
            self._unacked.clear()
            self._unacked.update(pending)
            self._trained_not_durable.clear()
            if self._unacked:
                logger.info("sampler %s resending %d unacked batches to the trainer", self.sampler_id,
                            len(self._unacked))
                for outgoing in self._unacked.values():
                    outgoing.next_send_at = 0.0

    def _on_ack(self, header: dict) -> None:
        self.trainer_policy_version = header["policy_version"]
        if header.get("weights_version") is not None and header.get("weights_path") is not None:
            self.latest_weights = (header["weights_version"], header["weights_path"])
        batch_id = header["batch_id"]
        outgoing = self._unacked.pop(batch_id, None)
        if header.get("durable", True):
            if (outgoing or self._trained_not_durable.pop(batch_id, None)) is not None:
                self.acked.append(batch_id)
        elif outgoing is not None:  # trained, no checkpoint lists it yet: free the slot, keep the frames
            self._trained_not_durable[batch_id] = outgoing

    def _on_dropped(self, header: dict) -> None:
        if self._unacked.pop(header["batch_id"], None) is not None:
            self.dropped.append((header["batch_id"], header["reason"]))
            logger.info("trainer dropped batch %s: %s", header["batch_id"], header["reason"])

    def _on_busy(self, header: dict) -> None:
        outgoing = self._unacked.get(header["batch_id"])
        if outgoing is not None:
            first, longest = BUSY_BACKOFF_S
            outgoing.next_send_at = time.monotonic() + min(longest, first * 2 ** outgoing.busy_count)
            outgoing.busy_count += 1

    def _on_weights(self, header: dict) -> None:
        self.latest_weights = (header["version"], header["path"])

    def _on_work(self, header: dict) -> None:
        # The answer to an earlier question may come late; a chunk still unacked here is being sent already
        # (the trainer has not read it yet): ask again rather than make it twice.
        if (self._next_want_at is not None and header["batch_id"] not in self._unacked
                and header["batch_id"] not in self._trained_not_durable):
            self._work = header

    def _on_heartbeat(self, header: dict) -> None:
        if "policy_version" in header:
            self.trainer_policy_version = header["policy_version"]

    def _on_bye(self, header: dict) -> None:
        self._bye_reason = header.get("reason", "no reason given")
        logger.warning("trainer at %s said bye: %s", self.address, self._bye_reason)

    def _on_error(self, header: dict) -> None:
        if header.get("code") == "hello_required":
            if self._welcomed:
                logger.info("trainer at %s does not know sampler %s (restarted?): saying hello again",
                            self.address, self.sampler_id)
            self._welcomed = False
            self._next_hello_at = 0.0
            return
        if header.get("code") in ("config_mismatch", "duplicate_sampler"):  # hello again cannot help: say why
            self._next_hello_at = time.monotonic() + 1e9  # never again
            self._refusal = f"trainer at {self.address} refused sampler {self.sampler_id}: {header['reason']}"
            return
        batch_id = header.get("batch_id")
        logger.error("trainer at %s refused %s: %s", self.address,
                     f"batch {batch_id}" if batch_id else "a message", header["reason"])
        if batch_id is not None and self._unacked.pop(batch_id, None) is not None:
            self.rejected.append((batch_id, header["reason"]))
            self._refusal = f"trainer at {self.address} refused batch {batch_id}: {header['reason']}"
