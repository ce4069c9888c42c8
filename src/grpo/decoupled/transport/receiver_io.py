"""The trainer side's I/O thread: checks every message from a sampler, answers it and queues its batches
(the conversation is described in ``grpo.decoupled.transport``)."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq

from grpo.decoupled.transport.common import HWM, LOST_AFTER_S, MAX_WARNED_PEERS, _label, routing_id
from grpo.decoupled.transport.deliveries import IncomingBatch
from grpo.decoupled.transport.io_thread import _IOThread
from grpo.decoupled.wire import (
    PROTOCOL_VERSION,
    Message,
    WireError,
    decode,
    encode,
    message_to_batch,
)
from grpo.decoupled.work_plan import Assignment, WorkPlan, chunk_of

logger = logging.getLogger("grpo.decoupled.transport")  # the package's name: its modules log as one


@dataclass
class _Peer:
    sampler_id: str
    incarnation: int
    connected_at: float
    last_seen: float
    last_seen_monotonic: float
    batches_received: int = 0
    host: str = "?"


@dataclass
class _Pending:
    identity: bytes
    sampler_id: str
    groups: tuple[str, ...] = ()  # partial rollouts: the chunk's group ids (its sampler holds them again if dropped)


class _ReceiverIO(_IOThread):
    """What ``RolloutReceiver``'s I/O thread does: check each sampler message, answer it, queue batches;
    and the sends that the receiver's API submits to that thread."""

    # set up by RolloutReceiver.__init__
    token: str
    max_message_bytes: int
    queue_size: int
    reply_errors: bool
    trainer_id: str
    _queue: deque[IncomingBatch]
    _pending: dict[str, _Pending]        # queued or handed out, not yet acked or dropped
    _not_durable: dict[str, bytes]       # trained, in no checkpoint yet (batch id -> sampler identity)
    _trained: dict[str, str]             # batch id -> sampler id
    _trained_per_sampler: Counter
    _dropped: dict[str, str]             # batch id -> reason
    _peers: dict[bytes, _Peer]           # by routing id (one per sampler process)
    _superseded: dict[bytes, tuple]      # routing id of a replaced process -> (sampler id, its incarnation,
                                         # the newer one's, the newer one's host)
    _warned: set[bytes]
    _policy_version: int
    _weights: tuple[int, str] | None     # (version, path) last announced
    _stats: Counter
    _work_plan: WorkPlan | None          # who makes which chunk; None: samplers send what they like
    _restored: dict[str, int]            # samplers of a restarted trainer's checkpoint -> incarnation, until hello
    _started_monotonic: float

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
            if identity in self._superseded and message.kind != "bye":  # hello too: it must not oust the newer
                self._reject(identity, self._duplicate_reason(identity), message.header, code="duplicate_sampler")
                return
            if message.kind == "hello":
                self._on_hello(identity, message.header)
                return
            if message.kind not in ("batch", "heartbeat", "bye", "want"):
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
            elif message.kind == "want":
                self._on_want(identity, peer)
            elif message.kind == "heartbeat":
                self._send(identity, "heartbeat", {"time": message.header.get("time", 0.0),
                                                   "policy_version": self._policy_version,
                                                   "trainer_id": self.trainer_id})
            else:
                del self._peers[identity]
                if self._work_plan is not None:
                    self._work_plan.forget_sampler(peer.sampler_id)
                logger.info("sampler %s said bye: %s", peer.sampler_id, message.header.get("reason", ""))

    def _duplicate_reason(self, identity: bytes) -> str:
        sampler_id, older, newer, host = self._superseded[identity]
        return (f"two processes run as {sampler_id}: incarnation {older} is still running after incarnation {newer} "
                f"(host {host}) said hello; give every sampler its own decoupled.sampler_index")

    def _refuse_superseded(self, identities: list[bytes]) -> None:
        """Tell replaced sampler processes that a newer one runs as them (I/O thread), so that a live one stops
        with the reason instead of waiting out its peer timeout. A restart's dead predecessor cannot be reached,
        which is no news: such a failed send is logged at DEBUG only."""
        if not self.reply_errors:
            return
        with self._cond:
            messages = [(identity, encode("error", {"reason": self._duplicate_reason(identity)[:500],
                                                    "code": "duplicate_sampler", "batch_id": None}, token=self.token))
                        for identity in identities]
        for identity, frames in messages:
            try:
                self._socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("cannot tell replaced process %s that it is refused: %s", _label(identity), exc)

    # --- the work plan (caller holds the lock) --------------------------------------------------

    def _alive_samplers(self) -> set[str]:
        """Samplers heard from lately: a chunk held by any other is given to the next sampler that asks."""
        now = time.monotonic()
        alive = {p.sampler_id for p in self._peers.values() if now - p.last_seen_monotonic <= LOST_AFTER_S}
        # A restarted trainer gives the samplers of its checkpoint as long to say hello again as a silent one has.
        return alive | set(self._restored) if now - self._started_monotonic <= LOST_AFTER_S else alive

    def _on_want(self, identity: bytes, peer: _Peer) -> None:
        if self._work_plan is None:
            self._reject(identity, "this trainer hands out no work (no work plan)", code="unexpected_kind")
            return
        assignment = self._work_plan.want(peer.sampler_id, self._alive_samplers())
        if assignment is not None:
            self._send_work(identity, assignment)

    def _send_work(self, identity: bytes, assignment: Assignment) -> None:
        if assignment.adopt:
            logger.info("%s adopts %d unsent group(s) of a sampler that restarted or went silent, with %s: %s",
                        _label(identity), len(assignment.adopt), assignment.chunk.id, " ".join(assignment.adopt))
        self._send(identity, "work", assignment.header())

    def _serve_waiting(self, work: list[tuple[str, Assignment]]) -> None:
        """Send work found for waiting samplers (from the I/O thread)."""
        for sampler_id, assignment in work:
            identity = next((i for i, p in self._peers.items() if p.sampler_id == sampler_id), None)
            if identity is not None:
                self._send_work(identity, assignment)

    def _on_hello(self, identity: bytes, header: dict) -> None:
        sampler_id, incarnation = header["sampler_id"], header["incarnation"]
        if routing_id(sampler_id, incarnation) != identity:
            self._reject(identity, f"hello names sampler {sampler_id[:64]!r} (incarnation {incarnation}) but the "
                                   f"connection's routing id is {_label(identity)!r}; a sampler's DEALER routing id "
                                   "must be routing_id(sampler id, incarnation)", code="wrong_sampler")
            return
        theirs = header.get("config_hash")
        if self.config_hash and theirs and theirs != self.config_hash:
            self._reject(identity, f"sampler {sampler_id[:64]} runs another config (hash {theirs[:12]}, the trainer's "
                                   f"{self.config_hash[:12]}): start every role with the same recipe and overrides",
                         code="config_mismatch")
            return
        now, wall = time.monotonic(), time.time()
        old_identity, old = next(((i, p) for i, p in self._peers.items() if p.sampler_id == sampler_id), (None, None))
        if old_identity is not None and old_identity != identity:
            # A restart, or a second process with the same index: the older one is replaced and refused (a
            # restarted sampler's dead predecessor never hears it).
            del self._peers[old_identity]
            self._superseded[old_identity] = (sampler_id, old.incarnation, incarnation, header.get("host", "?")[:64])
            logger.info("sampler %s restarted (incarnation %d -> %d)", sampler_id, old.incarnation, incarnation)
            self._refuse_superseded([old_identity])  # now: the run may end before the older speaks again
        elif old is None:
            logger.info("sampler %s connected (incarnation %d)", sampler_id, incarnation)
        restored = self._restored.pop(sampler_id, None)  # its incarnation in the checkpoint of a restarted trainer
        same_process = old.incarnation == incarnation if old is not None else restored == incarnation
        if self._work_plan is not None and not same_process:
            self._work_plan.forget_sampler(sampler_id)  # a restarted sampler makes nothing it was given before
        self._peers[identity] = _Peer(sampler_id, incarnation, wall, wall, now,
                                      old.batches_received if old is not None else 0, header.get("host", "?")[:64])
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
            self._send(identity, "ack", {"batch_id": batch_id, **self._ack_fields(),
                                         "durable": batch_id not in self._not_durable})
        elif batch_id in self._dropped:
            self._stats["duplicates"] += 1
            self._send(identity, "dropped", {"batch_id": batch_id, "reason": self._dropped[batch_id],
                                             "policy_version": self._policy_version})
        elif batch_id in self._pending:
            self._stats["duplicates"] += 1  # queued or in training already: its ack will follow
            logger.debug("batch %s from %s is already queued or in training", batch_id, peer.sampler_id)
            if self._pending[batch_id].sampler_id != peer.sampler_id:  # the ack goes to the first: free this one
                self._send(identity, "dropped", {"batch_id": batch_id, "policy_version": self._policy_version,
                                                 "reason": "another sampler's copy of this chunk came first"})
        elif self._work_plan is not None and not self._wanted_chunk(batch_id, peer):
            self._reject(identity, f"batch id {batch_id[:64]!r} names no chunk this trainer waits for "
                                   f"(chunk ids are step-S/rank-R, ranks < {self._work_plan.ranks})",
                         message.header, code="unknown_chunk")
        elif len(self._queue) >= self.queue_size:
            self._stats["busy"] += 1
            self._send(identity, "busy", {"batch_id": batch_id, "queue_depth": len(self._queue)})
        elif (problem := _group_lists_problem(meta)) is not None:
            self._reject(identity, f"batch {batch_id[:64]!r}: {problem}", message.header)
        else:
            if self._work_plan is not None:
                self._work_plan.arrived_from(chunk_of(batch_id), peer.sampler_id)
                if "carried" in meta:
                    self._work_plan.carries(peer.sampler_id, meta["carried"])
            self._queue.append(IncomingBatch(batch_id, peer.sampler_id, meta["policy_version"], batch, meta,
                                             time.time()))
            self._pending[batch_id] = _Pending(identity, peer.sampler_id, tuple(meta.get("groups", ())))
            self._stats["received"] += 1
            peer.batches_received += 1
            self._cond.notify_all()

    def _wanted_chunk(self, batch_id: str, peer: _Peer) -> bool:
        """Whether a batch (not trained, not queued) is a chunk the plan waits for."""
        chunk = chunk_of(batch_id)
        plan = self._work_plan
        return (chunk is not None and chunk.step > plan.trained_steps and chunk not in plan.arrived
                and chunk.rank < plan.ranks)


def _group_lists_problem(meta: dict) -> str | None:
    """What is wrong with a batch's partial-rollout group lists (``groups``: its groups, ``carried``: those its
    sampler holds unsent), or None."""
    for key in ("groups", "carried"):
        value = meta.get(key, [])
        if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
            return f"meta {key!r} must be a list of group ids (strings), got {type(value).__name__}"
    return None
