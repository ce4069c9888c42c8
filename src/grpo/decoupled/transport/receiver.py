"""Trainer side of the rollout transport: ``RolloutReceiver`` binds a ROUTER socket, queues the samplers'
batches and acknowledges them after training. What its I/O thread does is in ``receiver_io``."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping

import zmq

from grpo.decoupled.listen import check_bind_address
from grpo.decoupled.transport.common import HWM, TransportError, _check_version
from grpo.decoupled.transport.curve_keys import make_curve_server
from grpo.decoupled.transport.deliveries import IncomingBatch, PeerStatus
from grpo.decoupled.transport.receiver_io import _Peer, _Pending, _ReceiverIO
from grpo.decoupled.wire import DEFAULT_MAX_MESSAGE_BYTES, NUM_FRAMES, encode
from grpo.decoupled.work_plan import WorkPlan, chunk_of

logger = logging.getLogger("grpo.decoupled.transport")  # the package's name: its modules log as one


class RolloutReceiver(_ReceiverIO):
    """Trainer side: bind a ROUTER socket, queue the samplers' batches, acknowledge them after training.

    ``trained_ids`` / ``dropped_ids`` come from the trainer's checkpoint after a restart: a batch whose id
    is among them is answered (ack / dropped) at once and never returned by ``next_batch``. Pass the
    ``trained_ids`` mapping (batch id -> sampler id) saved from this property to keep per-sampler counts
    in ``welcome``; a plain set of ids works but those batches count for no sampler.

    With a ``work_plan`` the trainer decides what samplers make: they ask (``want``), it answers with an
    open chunk (``work``), and batches must be chunks (``grpo.decoupled.work_plan``); ``announce_weights``
    opens more steps, ``ack`` closes trained ones, and ``drop(..., final=False)`` has a chunk made again.

    ``curve_secret_key``: the trainer's CURVE secret key (``curve_keys.server_secret_key``); with it only
    samplers that encrypt to its public key can connect. None: plaintext.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:5555", token: str = "",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, queue_size: int = 4,
                 trained_ids: Mapping[str, str] | Iterable[str] | None = None,
                 dropped_ids: Mapping[str, str] | Iterable[str] | None = None, *,
                 policy_version: int = 0, reply_errors: bool = True, config_hash: str = "",
                 work_plan: WorkPlan | None = None, curve_secret_key: bytes | None = None,
                 carried_groups: Mapping | None = None):
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
        self.config_hash = config_hash  # a sampler whose hello carries another one is refused
        self._work_plan = work_plan
        self._restored = restore_carried(work_plan, carried_groups)  # sampler -> incarnation, until its hello
        self._started_monotonic = time.monotonic()
        self.trainer_id = secrets.token_hex(8)  # tells samplers that a trainer restarted
        self._max_frames = 1 + NUM_FRAMES       # routing id + message
        self._max_incoming_bytes = max_message_bytes + 256  # a routing id has at most 255 bytes
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[IncomingBatch] = deque()
        self._pending: dict[str, _Pending] = {}  # queued or handed out, not yet acked or dropped
        self._not_durable: dict[str, bytes] = {}  # trained, in no checkpoint yet: batch id -> sampler identity
        self._trained: dict[str, str] = (dict(trained_ids) if isinstance(trained_ids, Mapping)
                                         else dict.fromkeys(trained_ids or (), ""))
        self._trained_per_sampler = Counter(self._trained.values())
        self._dropped: dict[str, str] = (dict(dropped_ids) if isinstance(dropped_ids, Mapping)
                                         else dict.fromkeys(dropped_ids or (), "dropped before a restart"))
        self._peers: dict[bytes, _Peer] = {}
        self._superseded: dict[bytes, tuple] = {}
        self._warned: set[bytes] = set()
        self._policy_version = policy_version
        self._weights: tuple[int, str] | None = None
        self._stats = Counter({k: 0 for k in ("received", "trained", "dropped", "duplicates", "rejected", "busy",
                                              "unknown_peer", "send_failed")})

        self._context = zmq.Context()
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises instead of vanishing
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # ZeroMQ disconnects a peer sending a larger frame
        socket.setsockopt(zmq.RCVHWM, HWM)
        socket.setsockopt(zmq.SNDHWM, HWM)
        if curve_secret_key is not None:
            make_curve_server(socket, curve_secret_key)
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            socket.close()
            self._context.term()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to ":*"
        logger.info("rollout receiver listening on %s (trainer id %s, %s)", self.address, self.trainer_id,
                    "CURVE-encrypted" if curve_secret_key is not None else "plaintext")
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

    def ack(self, batch_id: str, policy_version: int | None = None, durable: bool = True) -> None:
        """Record ``batch_id`` as trained and tell its sampler (which frees its slot).

        ``policy_version``: the trainer's version after training it (default: the announced one).
        ``durable``: False when no checkpoint lists the batch yet; the sampler then keeps it to resend
        to a restarted trainer until ``confirm_durable`` (after the next checkpoint) says so.
        """
        self._check_open()
        with self._cond:
            # Encoding first checks the arguments before any state changes.
            frames = encode("ack", {"batch_id": batch_id, **self._ack_fields(policy_version), "durable": durable},
                            token=self.token)
            pending = self._finish(batch_id)
            self._trained[batch_id] = pending.sampler_id
            self._trained_per_sampler[pending.sampler_id] += 1
            self._stats["trained"] += 1
            if not durable:
                self._not_durable[batch_id] = pending.identity
        self._submit(lambda: self._send_frames(pending.identity, "ack", frames))

    def confirm_durable(self, policy_version: int | None = None) -> int:
        """A checkpoint listing every trained batch is on disk: send the durable acks that were held
        back; returns how many."""
        self._check_open()
        with self._cond:
            held, self._not_durable = self._not_durable, {}
            messages = [(identity, encode("ack", {"batch_id": batch_id, **self._ack_fields(policy_version),
                                                  "durable": True}, token=self.token))
                        for batch_id, identity in held.items()]
        for identity, frames in messages:
            self._submit(lambda identity=identity, frames=frames: self._send_frames(identity, "ack", frames))
        return len(messages)

    def drop(self, batch_id: str, reason: str, policy_version: int | None = None, final: bool = True) -> None:
        """Discard ``batch_id`` untrained (e.g. too stale) and tell its sampler why. ``final``: a later copy
        is dropped too; else (a chunk of the work plan) the chunk is handed out to be made again."""
        self._check_open()
        with self._cond:
            version = self._policy_version if policy_version is None else policy_version
            frames = encode("dropped", {"batch_id": batch_id, "reason": reason, "policy_version": version},
                            token=self.token)
            pending = self._finish(batch_id)
            if final:
                self._dropped[batch_id] = reason
            self._stats["dropped"] += 1
            work = []
            if self._work_plan is not None and (chunk := chunk_of(batch_id)) is not None:
                self._work_plan.reopen(chunk)
                if pending.groups:  # its sampler starts them over (or, dead, orphans them)
                    self._work_plan.owes(pending.sampler_id, pending.groups)
                work = self._work_plan.serve_waiting(self._alive_samplers())
        self._submit(lambda: (self._send_frames(pending.identity, "dropped", frames), self._serve_waiting(work)))

    def step_trained(self, step: int) -> None:
        """Every chunk of ``step`` is trained (the work plan forgets them)."""
        with self._cond:
            if self._work_plan is not None:
                self._work_plan.trained(step)

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
            work = self._work_plan.published(version, self._alive_samplers()) if self._work_plan is not None else []

        def send_all() -> None:
            for identity in list(self._peers):
                self._send_frames(identity, "weights", frames)
            self._serve_waiting(work)  # after the weights: a sampler told to use them knows where they are

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
    def carried_groups(self) -> dict:
        """The partial-rollout groups each sampler holds unsent (with its incarnation) and the orphans no sampler
        has adopted yet, as checkpoints keep them (``carried_groups`` of a restarted trainer's receiver)."""
        with self._cond:
            if self._work_plan is None:
                return {"carried": {}, "orphans": []}
            incarnations = {**self._restored, **{p.sampler_id: p.incarnation for p in self._peers.values()}}
            return {"carried": {s: {"incarnation": incarnations.get(s, -1), "groups": sorted(groups)}
                                for s, groups in self._work_plan.carried.items() if groups},
                    "orphans": sorted(self._work_plan.orphans)}

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
        """Stop and close the socket; with ``bye_reason``, say bye to every sampler first (0.5 s linger), and
        refuse again every process a newer one with its sampler id replaced (a bye would tell it the run
        finished; its refusal at the replacement may have been lost)."""
        if bye_reason is not None and getattr(self, "_thread", None) is not None and self._thread.is_alive():
            frames = encode("bye", {"reason": bye_reason}, token=self.token)

            def send_byes() -> None:
                for identity in list(self._peers):
                    self._send_frames(identity, "bye", frames)
                with self._cond:
                    superseded = list(self._superseded)
                self._refuse_superseded(superseded)

            self._submit(send_byes)
        self._stop_io(linger_ms=500 if bye_reason is not None else 0)

    def __enter__(self) -> RolloutReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals (the caller's thread, lock held) -----------------------------------------------

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


def restore_carried(work_plan: WorkPlan | None, saved: Mapping | None) -> dict[str, int]:
    """Put a checkpoint's ``carried_groups`` into ``work_plan``; returns each sampler's incarnation there. A sampler
    that says hello again as that incarnation keeps its groups (it lived through the trainer's restart); another
    incarnation, or none within the time a silent sampler has, orphans them."""
    if not saved:
        return {}
    if work_plan is None:
        raise ValueError("carried_groups need a work plan")
    try:
        restored = {str(s): int(held["incarnation"]) for s, held in saved["carried"].items()}
        for sampler, held in saved["carried"].items():
            work_plan.carries(sampler, [str(g) for g in held["groups"]])
        work_plan.orphans |= {str(g) for g in saved["orphans"]}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"carried_groups must be {{'carried': {{sampler: {{'incarnation': int, 'groups': [ids]}}}}, "
                         f"'orphans': [ids]}} (a checkpoint's trainer_state.json): {exc!r}") from None
    return restored
