"""Rollout batches from sampler processes to the trainer's rank 0 over ZeroMQ (decoupled mode).

The trainer binds one ROUTER socket (``RolloutReceiver``); each sampler connects a DEALER socket whose
routing id is its sampler id (``RolloutSender``). Every message is a ``grpo.wire`` message (JSON header
+ safetensors payload, shared token, size limits; never pickle). The conversation::

    sampler                                   trainer (rank 0)
    hello {sampler_id, incarnation}      ->
                                         <-   welcome {policy_version, trained_count, pending_count,
                                                       protocol, trainer_id, max_message_bytes, weights_path}
    batch {batch_id, sampler_id,         ->  queued (FIFO, at most queue_size), or
           policy_version, meta, completions, prompts, reward_names, columns} + safetensors tensors
                                         <-   busy {batch_id, queue_depth}      queue full: resend later
                                         <-   ack {batch_id, policy_version, weights_version, weights_path}
                                              at once if batch_id was trained before (a resend after a restart)
                                         <-   ack {...}                     after the trainer trained it
                                         <-   dropped {batch_id, reason, policy_version}   stale, not trained
                                         <-   weights {version, path}       new weights published (to every sampler)
    heartbeat {time}                     ->
                                         <-   heartbeat {time, policy_version, trainer_id}
    bye {reason}                        <->   either side leaves
                                         <-   error {reason, code, batch_id}  a rejected message; code
                                              "hello_required" asks the sampler to say hello again
                                              (the trainer restarted and does not know it)

Each endpoint runs one background I/O thread that owns its socket, so heartbeats are answered and
batches received while the caller trains or generates; the public methods are thread-safe. Samplers
keep every unacknowledged batch (its encoded frames); when a trainer restarts, the sampler's next
heartbeat is answered with ``hello_required``, it says hello again and resends what is unacked. The
receiver acknowledges a batch it already trained without returning it again, so with ``trained_ids``
kept in the trainer's checkpoint every batch is trained exactly once.

Listening beyond this machine needs a token (``check_bind_address``). A malformed, oversized,
wrong-version or unauthenticated message is counted in ``stats["rejected"]``, logged (at WARNING the
first time per peer), answered with ``error`` and otherwise ignored.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from grpo.records import RolloutBatch
from grpo.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    NUM_FRAMES,
    PROTOCOL_VERSION,
    Message,
    WireError,
    batch_to_message,
    decode,
    encode,
    message_to_batch,
)

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
HWM = 1000                      # messages queued per peer and direction before sends fail / reads stop
POLL_MS = 100                   # longest sleep of an I/O thread (it also wakes on commands and messages)
MAX_MESSAGES_PER_WAKE = 64      # an I/O thread then runs its commands and timers again
MAX_WARNED_PEERS = 4096         # bound on the "already warned about this peer" memory
BUSY_BACKOFF_S = (0.1, 2.0)     # first and longest wait before a sampler resends a batch refused as busy
MAX_EVENTS = 10_000             # events kept for poll(); the oldest go first (state is kept separately)
# What a sampler accepts from the trainer: control messages only (the longest is an error reason, cut at
# 500 characters, or a weights path), so far less than a batch.
CONTROL_MAX_BYTES = 1024 * 1024


class TransportError(RuntimeError):
    """The transport cannot go on (its I/O thread failed, a peer refused a batch, a socket cannot bind)."""


class PeerTimeout(TransportError, TimeoutError):
    """The other side did not answer in time."""


class PeerClosed(TransportError):
    """The trainer said bye while this sampler was waiting for it."""


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


def _check_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"a policy version is an int, got {version!r}")


def _label(identity: bytes) -> str:
    """A routing id as text for logs: the sampler id, or hex for ZeroMQ's generated ids."""
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + identity.hex()
    return text if text.isprintable() and text else "0x" + identity.hex()


class _Wakeup:
    """A pipe an I/O thread polls beside its socket, so other threads can wake it at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        with self._lock:  # never write to a closed (possibly reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the thread will wake

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


def _recv_bounded(socket: zmq.Socket, max_frames: int, max_bytes: int) -> tuple[list[bytes], str]:
    """One multipart message without blocking (zmq.Again when none is waiting): ``(frames, "")``.

    Keeps at most ``max_frames`` frames and ``max_bytes`` bytes in memory (ZeroMQ's MAXMSGSIZE bounds
    single frames only, not how many a message has): the rest of a larger message is read and
    discarded, and ``([first_frame], reason)`` returned (a ROUTER's first frame is the routing id).
    """
    first = socket.recv(zmq.NOBLOCK)
    frames, count, total, over = [first], 1, len(first), False
    while socket.getsockopt(zmq.RCVMORE):
        frame = socket.recv()  # the rest of a multipart message has arrived with its first frame
        count, total = count + 1, total + len(frame)
        over = over or count > max_frames or total > max_bytes
        if not over:
            frames.append(frame)
    if over:
        return [first], f"message of {count} frames and {total} bytes exceeds {max_frames} frames / {max_bytes} bytes"
    return frames, ""


class _IOThread:
    """Base of both endpoints: a daemon thread owning a socket, running commands other threads submit."""

    def _start_io(self, socket: zmq.Socket, name: str) -> None:
        self._socket = socket
        self._wakeup = _Wakeup()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._failure: BaseException | None = None
        self._close_linger_ms = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _check_open(self) -> None:
        self._raise_if_failed()
        if getattr(self, "_thread", None) is None or not self._thread.is_alive():
            raise TransportError(f"{type(self).__name__} is closed")

    def _submit(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the I/O thread (the only thread that touches the socket)."""
        self._check_open()
        with self._cond:
            self._commands.append(command)
        self._wakeup.set()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakeup.fileno(), zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._poll_ms()))
                self._wakeup.clear()
                while True:
                    with self._cond:
                        command = self._commands.popleft() if self._commands else None
                    if command is None:
                        break
                    command()
                if self._stopping:  # nothing after a last command (e.g. a heartbeat after the bye)
                    break
                if self._socket in ready:
                    self._receive_some()
                self._on_timer(time.monotonic())
        except Exception as exc:  # reported to the caller's next wait instead of dying silently
            logger.exception("%s: I/O thread failed", self._thread.name)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
        finally:
            self._socket.close(linger=self._close_linger_ms)

    def _receive_some(self) -> None:
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                frames, problem = _recv_bounded(self._socket, self._max_frames, self._max_incoming_bytes)
            except zmq.Again:
                return
            self._on_frames(frames, problem)

    def _stop_io(self, linger_ms: int = 0) -> None:
        """Stop the thread (after the commands already submitted) and close the socket and context."""
        if getattr(self, "_thread", None) is None:
            return

        def stop() -> None:
            self._close_linger_ms = linger_ms
            self._stopping = True

        if self._thread.is_alive():
            with self._cond:
                self._commands.append(stop)
            self._wakeup.set()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                logger.error("%s: I/O thread did not stop within 10 s", self._thread.name)
                return
        self._wakeup.close()
        self._context.term()
        self._thread = None

    def _raise_if_failed(self) -> None:
        if getattr(self, "_failure", None) is not None:
            raise TransportError(f"{type(self).__name__} I/O thread failed: {self._failure!r}") from self._failure

    # implemented by the endpoints
    _cond: threading.Condition
    _context: zmq.Context
    _max_frames: int
    _max_incoming_bytes: int

    def _poll_ms(self) -> int:
        return POLL_MS

    def _on_frames(self, frames: list[bytes], problem: str) -> None:
        raise NotImplementedError

    def _on_timer(self, now: float) -> None:
        pass


# ---------------------------------------------------------------------------------------------------
# Trainer side
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IncomingBatch:
    """A batch the trainer should train (once) and then ``ack`` or ``drop``."""

    batch_id: str
    sampler_id: str
    policy_version: int      # the weights version the sampler generated it with
    batch: RolloutBatch
    meta: dict               # batch_id, sampler_id, policy_version and the sampler's other keys
    received_at: float       # time.time()


@dataclass(frozen=True)
class PeerStatus:
    """A sampler the receiver knows (it said hello)."""

    sampler_id: str
    incarnation: int
    connected_at: float          # time.time() of its last hello
    last_seen: float             # time.time() of its last valid message
    seconds_since_seen: float
    batches_received: int        # queued by this receiver (duplicates and busy refusals not counted)


@dataclass
class _Peer:
    sampler_id: str
    incarnation: int
    connected_at: float
    last_seen: float
    last_seen_monotonic: float
    batches_received: int = 0


@dataclass
class _Pending:
    identity: bytes
    sampler_id: str


class RolloutReceiver(_IOThread):
    """Trainer side: bind a ROUTER socket, queue the samplers' batches, acknowledge them after training.

    ``trained_ids`` / ``dropped_ids`` come from the trainer's checkpoint after a restart: a batch whose id
    is among them is answered (ack / dropped) at once and never returned by ``next_batch``. Pass the
    ``trained_ids`` mapping (batch id -> sampler id) saved from this property to keep per-sampler counts
    in ``welcome``; a plain set of ids works but those batches count for no sampler.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:5555", token: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, queue_size: int = 4,
                 trained_ids: Mapping[str, str] | Iterable[str] | None = None,
                 dropped_ids: Mapping[str, str] | Iterable[str] | None = None, *,
                 policy_version: int = 0, reply_errors: bool = True):
        check_bind_address(address, token)
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        _check_version(policy_version)
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.queue_size = queue_size
        self.reply_errors = reply_errors
        self.trainer_id = secrets.token_hex(8)  # tells samplers that a trainer restarted
        self._max_frames = 1 + NUM_FRAMES       # routing id + message
        self._max_incoming_bytes = max_message_bytes + 256  # a routing id has at most 255 bytes
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[IncomingBatch] = deque()
        self._pending: dict[str, _Pending] = {}  # queued or handed out, not yet acked or dropped
        self._trained: dict[str, str] = (dict(trained_ids) if isinstance(trained_ids, Mapping)
                                         else dict.fromkeys(trained_ids or (), ""))
        self._trained_per_sampler = Counter(self._trained.values())
        self._dropped: dict[str, str] = (dict(dropped_ids) if isinstance(dropped_ids, Mapping)
                                         else dict.fromkeys(dropped_ids or (), "dropped before a restart"))
        self._peers: dict[bytes, _Peer] = {}
        self._warned: set[bytes] = set()
        self._policy_version = policy_version
        self._weights: tuple[int, str] | None = None
        self._stats = Counter({k: 0 for k in ("received", "trained", "dropped", "duplicates", "rejected", "busy",
                                              "unknown_peer", "send_failed")})

        self._context = zmq.Context()
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises instead of vanishing
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a restarted sampler takes over its routing id
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # ZeroMQ disconnects a peer sending a larger frame
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.SNDHWM, HWM)
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            socket.close()
            self._context.term()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to ":*"
        logger.info("rollout receiver listening on %s (trainer id %s)", self.address, self.trainer_id)
        self._start_io(socket, f"rollout-receiver {self.address}")

    # --- the trainer's API ----------------------------------------------------------------------

    def next_batch(self, timeout_s: float) -> IncomingBatch | None:
        """The oldest queued batch, waiting up to ``timeout_s`` for one; None when none arrived."""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._queue:
                    return self._queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def ack(self, batch_id: str, policy_version: int | None = None) -> None:
        """Record ``batch_id`` as trained and tell its sampler (which frees its slot).

        ``policy_version``: the trainer's version after training it (default: the announced one).
        """
        self._check_open()
        with self._cond:
            # Encoding first checks the arguments before any state changes.
            frames = encode("ack", {"batch_id": batch_id, **self._ack_fields(policy_version)}, token=self.token)
            pending = self._finish(batch_id)
            self._trained[batch_id] = pending.sampler_id
            self._trained_per_sampler[pending.sampler_id] += 1
            self._stats["trained"] += 1
        self._submit(lambda: self._send_frames(pending.identity, "ack", frames))

    def drop(self, batch_id: str, reason: str, policy_version: int | None = None) -> None:
        """Discard ``batch_id`` untrained (e.g. too stale) and tell its sampler why."""
        self._check_open()
        with self._cond:
            version = self._policy_version if policy_version is None else policy_version
            frames = encode("dropped", {"batch_id": batch_id, "reason": reason, "policy_version": version},
                            token=self.token)
            pending = self._finish(batch_id)
            self._dropped[batch_id] = reason
            self._stats["dropped"] += 1
        self._submit(lambda: self._send_frames(pending.identity, "dropped", frames))

    def set_policy_version(self, version: int) -> None:
        """The policy version announced in welcome, ack and heartbeat replies."""
        _check_version(version)
        with self._cond:
            self._policy_version = version

    def announce_weights(self, version: int, path: str) -> None:
        """Tell every known sampler that weights ``version`` are ready at ``path`` (and remember it)."""
        frames = encode("weights", {"version": version, "path": path}, token=self.token)
        self._check_open()
        with self._cond:
            self._policy_version = version
            self._weights = (version, path)

        def send_all() -> None:
            for identity in list(self._peers):
                self._send_frames(identity, "weights", frames)

        self._submit(send_all)

    @property
    def policy_version(self) -> int:
        with self._cond:
            return self._policy_version

    @property
    def stats(self) -> dict[str, int]:
        """Counters: received, trained (= acked), dropped, duplicates, rejected, busy, unknown_peer,
        send_failed; and now: queue_depth, in_training (handed out, not acked), peers."""
        with self._cond:
            out = dict(self._stats)
            out["acked"] = out["trained"]
            out["queue_depth"] = len(self._queue)
            out["in_training"] = len(self._pending) - len(self._queue)
            out["peers"] = len(self._peers)
            return out

    @property
    def trained_ids(self) -> dict[str, str]:
        """Every trained batch id -> its sampler id (save it with the checkpoint)."""
        with self._cond:
            return dict(self._trained)

    @property
    def dropped_ids(self) -> dict[str, str]:
        """Every dropped batch id -> the reason."""
        with self._cond:
            return dict(self._dropped)

    def peers(self) -> dict[str, PeerStatus]:
        """The samplers that said hello, by sampler id."""
        now = time.monotonic()
        with self._cond:
            return {p.sampler_id: PeerStatus(p.sampler_id, p.incarnation, p.connected_at, p.last_seen,
                                             now - p.last_seen_monotonic, p.batches_received)
                    for p in self._peers.values()}

    def lost_peers(self, timeout_s: float) -> list[str]:
        """Sampler ids not heard from (no message, not even a heartbeat) for more than ``timeout_s``."""
        return sorted(s for s, p in self.peers().items() if p.seconds_since_seen > timeout_s)

    def close(self, bye_reason: str | None = None) -> None:
        """Stop and close the socket; with ``bye_reason``, say bye to every sampler first (0.5 s linger)."""
        if bye_reason is not None and getattr(self, "_thread", None) is not None and self._thread.is_alive():
            frames = encode("bye", {"reason": bye_reason}, token=self.token)

            def send_byes() -> None:
                for identity in list(self._peers):
                    self._send_frames(identity, "bye", frames)

            self._submit(send_byes)
        self._stop_io(linger_ms=500 if bye_reason is not None else 0)

    def __enter__(self) -> RolloutReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals (I/O thread unless noted) --------------------------------------------------------

    def _finish(self, batch_id: str) -> _Pending:
        """Remove a batch from the pending set (caller holds the lock); a loud error for an unknown id."""
        pending = self._pending.pop(batch_id, None)
        if pending is None:
            state = "already trained" if batch_id in self._trained else (
                "already dropped" if batch_id in self._dropped else "never received")
            raise KeyError(f"batch {batch_id!r} is not waiting to be trained ({state})")
        for index, item in enumerate(self._queue):  # acked or dropped before next_batch handed it out
            if item.batch_id == batch_id:
                del self._queue[index]
                break
        return pending

    def _ack_fields(self, policy_version: int | None = None) -> dict:
        version = self._policy_version if policy_version is None else policy_version
        weights_version, weights_path = self._weights if self._weights is not None else (None, None)
        return {"policy_version": version, "weights_version": weights_version, "weights_path": weights_path}

    def _send(self, identity: bytes, kind: str, header: dict) -> bool:
        return self._send_frames(identity, kind, encode(kind, header, token=self.token))

    def _send_frames(self, identity: bytes, kind: str, frames: list[bytes]) -> bool:
        """Send without blocking (I/O thread). A gone peer is forgotten; a full queue loses the message."""
        try:
            self._socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            with self._cond:
                self._stats["send_failed"] += 1
                if exc.errno == zmq.EHOSTUNREACH:
                    peer = self._peers.pop(identity, None)
                    logger.warning("cannot send %s to %s: it disconnected%s", kind, _label(identity),
                                   " (forgotten until it says hello again)" if peer else "")
                elif exc.errno == zmq.EAGAIN:
                    logger.warning("cannot send %s to %s: it is not reading (%d messages queued)",
                                   kind, _label(identity), HWM)
                else:
                    raise
            return False

    def _reject(self, identity: bytes, reason: str, header: dict | None = None, code: str = "bad_message") -> None:
        with self._cond:
            self._stats["rejected"] += 1
            first = identity not in self._warned
            if first:
                if len(self._warned) >= MAX_WARNED_PEERS:
                    self._warned.clear()
                self._warned.add(identity)
        if first:
            logger.warning("rejected a message from %s: %s (later rejections from it are logged at DEBUG)",
                           _label(identity), reason)
        else:
            logger.debug("rejected a message from %s: %s", _label(identity), reason)
        if self.reply_errors:
            batch_id = header.get("batch_id") if header else None
            self._send(identity, "error", {"reason": reason[:500], "code": code,
                                           "batch_id": batch_id if isinstance(batch_id, str) else None})

    def _on_frames(self, frames: list[bytes], problem: str) -> None:
        identity, body = frames[0], frames[1:]
        try:
            if problem:  # too many frames or bytes, read and discarded
                raise WireError(problem)
            message = decode(body, token=self.token, max_bytes=self.max_message_bytes)
        except WireError as exc:
            self._reject(identity, str(exc), exc.header)
            return
        with self._cond:
            if message.kind == "hello":
                self._on_hello(identity, message.header)
                return
            if message.kind not in ("batch", "heartbeat", "bye"):
                self._reject(identity, f"a sampler does not send {message.kind} messages", message.header,
                             code="unexpected_kind")
                return
            peer = self._peers.get(identity)
            if peer is None:
                self._stats["unknown_peer"] += 1
                if message.kind != "bye":
                    logger.info("%s sent %s before hello (trainer restarted?): asking it to say hello",
                                _label(identity), message.kind)
                    self._send(identity, "error", {"reason": "say hello first", "code": "hello_required",
                                                   "batch_id": message.header.get("batch_id")})
                return
            peer.last_seen, peer.last_seen_monotonic = time.time(), time.monotonic()
            if message.kind == "batch":
                self._on_batch(identity, peer, message)
            elif message.kind == "heartbeat":
                self._send(identity, "heartbeat", {"time": message.header.get("time", 0.0),
                                                   "policy_version": self._policy_version,
                                                   "trainer_id": self.trainer_id})
            else:
                del self._peers[identity]
                logger.info("sampler %s said bye: %s", peer.sampler_id, message.header.get("reason", ""))

    def _on_hello(self, identity: bytes, header: dict) -> None:
        sampler_id, incarnation = header["sampler_id"], header["incarnation"]
        if sampler_id.encode("utf-8") != identity:
            self._reject(identity, f"hello names sampler {sampler_id[:64]!r} but the connection's routing id is "
                                   f"{_label(identity)!r}; the sampler's DEALER routing id must be its sampler id",
                         code="wrong_sampler")
            return
        now, wall = time.monotonic(), time.time()
        old = self._peers.get(identity)
        if old is not None and old.incarnation != incarnation:
            logger.info("sampler %s restarted (incarnation %d -> %d)", sampler_id, old.incarnation, incarnation)
        elif old is None:
            logger.info("sampler %s connected (incarnation %d)", sampler_id, incarnation)
        self._peers[identity] = _Peer(sampler_id, incarnation, wall, wall, now,
                                      old.batches_received if old is not None else 0)
        self._send(identity, "welcome", {
            "policy_version": self._policy_version,
            "trained_count": self._trained_per_sampler[sampler_id],
            "pending_count": sum(p.sampler_id == sampler_id for p in self._pending.values()),
            "protocol": PROTOCOL_VERSION, "trainer_id": self.trainer_id,
            "max_message_bytes": self.max_message_bytes,
            "weights_path": self._weights[1] if self._weights is not None else None,
        })

    def _on_batch(self, identity: bytes, peer: _Peer, message: Message) -> None:
        try:
            batch, meta = message_to_batch(message)
        except WireError as exc:
            self._reject(identity, str(exc), exc.header)
            return
        batch_id = meta["batch_id"]
        if meta["sampler_id"] != peer.sampler_id:
            self._reject(identity, f"batch {batch_id[:64]!r} names sampler {meta['sampler_id'][:64]!r} but came "
                                   f"from {peer.sampler_id!r}", message.header, code="wrong_sampler")
            return
        if batch_id in self._trained:
            self._stats["duplicates"] += 1
            logger.info("batch %s from %s was trained before: acknowledged again", batch_id, peer.sampler_id)
            self._send(identity, "ack", {"batch_id": batch_id, **self._ack_fields()})
        elif batch_id in self._dropped:
            self._stats["duplicates"] += 1
            self._send(identity, "dropped", {"batch_id": batch_id, "reason": self._dropped[batch_id],
                                             "policy_version": self._policy_version})
        elif batch_id in self._pending:
            self._stats["duplicates"] += 1  # queued or in training already: its ack will follow
            logger.debug("batch %s from %s is already queued or in training", batch_id, peer.sampler_id)
        elif len(self._queue) >= self.queue_size:
            self._stats["busy"] += 1
            self._send(identity, "busy", {"batch_id": batch_id, "queue_depth": len(self._queue)})
        else:
            self._queue.append(IncomingBatch(batch_id, peer.sampler_id, meta["policy_version"], batch, meta,
                                             time.time()))
            self._pending[batch_id] = _Pending(identity, peer.sampler_id)
            self._stats["received"] += 1
            peer.batches_received += 1
            self._cond.notify_all()


# ---------------------------------------------------------------------------------------------------
# Sampler side
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """Something the trainer told this sampler: kind (welcome, ack, dropped, busy, weights, error, bye)
    and the message's header fields."""

    kind: str
    header: dict


@dataclass
class _Outgoing:
    frames: list[bytes]
    next_send_at: float | None  # monotonic time of the next (re)send; None once sent
    busy_count: int = 0


class RolloutSender(_IOThread):
    """Sampler side: connect a DEALER socket to the trainer and stream batches, at most ``max_inflight``
    unacknowledged at a time.

    ``timeout_s`` is how long the trainer may stay silent (not even answering heartbeats) before a wait
    raises PeerTimeout; a wait logs a WARNING status line every ``timeout_s / 2`` meanwhile.
    """

    def __init__(self, address: str, sampler_id: str, token: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_inflight: int = 1,
                 timeout_s: float = 60.0, *, heartbeat_s: float | None = None):
        raw_id = sampler_id.encode("utf-8") if isinstance(sampler_id, str) else b""
        if not 1 <= len(raw_id) <= 255 or raw_id.startswith(b"\0"):
            raise ValueError(f"sampler_id must be 1 to 255 UTF-8 bytes not starting with NUL, got {sampler_id!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.sampler_id = sampler_id
        self.token = token
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
        socket.setsockopt(zmq.ROUTING_ID, self.sampler_id.encode("utf-8"))
        socket.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE stays 0: with 1, ZeroMQ discards messages already received but not yet read when the
        # connection drops (a trainer's last ack or bye). What queues meanwhile reaches the next trainer,
        # which answers it as a stranger (hello_required) or as a duplicate.
        socket.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)  # the trainer sends control messages only
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.SNDHWM, HWM)
        try:
            socket.connect(self.address)
        except zmq.ZMQError as exc:
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
            if meta["batch_id"] in self._unacked:
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
            self._wait(lambda: not self._unacked, "waiting for the last acks", timeout_s)

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
            times += [o.next_send_at for o in self._unacked.values() if o.next_send_at is not None]
        wait_s = min(times) - time.monotonic()
        return max(0, min(POLL_MS, int(wait_s * 1000) + 1))

    def _on_timer(self, now: float) -> None:
        with self._cond:
            if not self._welcomed:
                if now >= self._next_hello_at:
                    hello = encode("hello", {"sampler_id": self.sampler_id, "incarnation": self.incarnation},
                                   token=self.token)
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
            if self._unacked:
                logger.info("sampler %s resending %d unacked batches to the trainer", self.sampler_id,
                            len(self._unacked))
                for outgoing in self._unacked.values():
                    outgoing.next_send_at = 0.0

    def _on_ack(self, header: dict) -> None:
        self.trainer_policy_version = header["policy_version"]
        if header.get("weights_version") is not None and header.get("weights_path") is not None:
            self.latest_weights = (header["weights_version"], header["weights_path"])
        if self._unacked.pop(header["batch_id"], None) is not None:
            self.acked.append(header["batch_id"])

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
        batch_id = header.get("batch_id")
        logger.error("trainer at %s refused %s: %s", self.address,
                     f"batch {batch_id}" if batch_id else "a message", header["reason"])
        if batch_id is not None and self._unacked.pop(batch_id, None) is not None:
            self.rejected.append((batch_id, header["reason"]))
            self._refusal = f"trainer at {self.address} refused batch {batch_id}: {header['reason']}"
