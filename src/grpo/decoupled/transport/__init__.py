"""Rollout batches from sampler processes to the trainer's rank 0 over ZeroMQ (decoupled mode).

The trainer binds one ROUTER socket (``RolloutReceiver``); each sampler process connects a DEALER socket whose
routing id is its sampler id and incarnation (``RolloutSender``, ``common.routing_id``). Every message is a
``grpo.decoupled.wire`` message (JSON header + safetensors payload, shared token, size limits; never pickle).
The conversation::

    sampler                                   trainer (rank 0)
    hello {sampler_id, incarnation,      ->
           config_hash, host}
                                         <-   welcome {policy_version, trained_count, pending_count,
                                                       protocol, trainer_id, max_message_bytes, weights_path}
                                         <-   error {code "config_mismatch"}   another recipe: refused
    want {}                              ->   (a trainer with a work plan, grpo.decoupled.work_plan)
                                         <-   work {batch_id, step, rank, min_version}  at once, or when a
                                              chunk opens (new weights); asked again every second until then
    batch {batch_id, sampler_id,         ->  queued (FIFO, at most queue_size), or
           policy_version, meta, completions, prompts, reward_names, columns} + safetensors tensors
                                         <-   busy {batch_id, queue_depth}      queue full: resend later
                                         <-   ack {batch_id, policy_version, weights_version, weights_path}
                                              at once if batch_id was trained before (a resend after a restart)
                                         <-   ack {...}                     after the trainer trained it
                                         <-   dropped {batch_id, reason, policy_version}   stale, or another
                                              sampler's copy of the chunk came first: not trained
                                         <-   weights {version, path}       new weights published (to every sampler)
    heartbeat {time}                     ->
                                         <-   heartbeat {time, policy_version, trainer_id}
    bye {reason}                        <->   either side leaves
                                         <-   error {reason, code, batch_id}  a rejected message; code
                                              "hello_required" asks the sampler to say hello again
                                              (the trainer restarted and does not know it); code
                                              "duplicate_sampler": a newer process said hello with this
                                              sampler id while this one still runs (two hosts, one index)

Each endpoint runs one background I/O thread that owns its socket, so heartbeats are answered and
batches received while the caller trains or generates; the public methods are thread-safe. Samplers
keep every unacknowledged batch (its encoded frames); when a trainer restarts, the sampler's next
heartbeat is answered with ``hello_required``, it says hello again and resends what is unacked. The
receiver acknowledges a batch it already trained without returning it again, so with ``trained_ids``
kept in the trainer's checkpoint every batch is trained exactly once.

A sampler process that says hello under a sampler id already in use replaces the older process (a restart, or
two processes started with one index): the older one is sent ``duplicate_sampler`` at once, again at the
receiver's ``close(bye_reason)``, and in answer to anything it says later (a hello too), so a live one stops
with that reason even when the run ends before it speaks again.

Listening beyond this machine needs a token (``check_bind_address``). A malformed, oversized,
wrong-version or unauthenticated message is counted in ``stats["rejected"]``, logged (at WARNING the
first time per peer), answered with ``error`` and otherwise ignored. With a CURVE key pair (the
receiver's ``curve_secret_key``, the senders' ``curve_server_key``) every frame is encrypted; a sampler
whose handshake fails (another key, one side not encrypting) gets a TransportError within a second.

The code: ``common`` (constants, errors; ``check_bind_address`` is in grpo.decoupled.listen), ``records``
(what the endpoints hand their callers), ``io_thread`` (the background thread both endpoints run), ``receiver`` and
``receiver_io`` (trainer side: its API, and what its I/O thread does), ``sender`` and ``sender_io``
(sampler side, likewise), ``curve_keys`` (the trainer's key pair on the run folder, the CURVE socket
options, why a handshake failed).
"""

from grpo.decoupled.transport.common import (
    BUSY_BACKOFF_S,
    CONTROL_MAX_BYTES,
    HWM,
    MAX_EVENTS,
    MAX_MESSAGES_PER_WAKE,
    MAX_WARNED_PEERS,
    POLL_MS,
    PeerClosed,
    PeerTimeout,
    TransportError,
)
from grpo.decoupled.listen import LOOPBACK_HOSTS, check_bind_address  # who may listen where: stdlib and the config
from grpo.decoupled.transport.deliveries import Event, IncomingBatch, PeerStatus
from grpo.decoupled.transport.receiver import RolloutReceiver
from grpo.decoupled.transport.sender import RolloutSender

__all__ = [
    "BUSY_BACKOFF_S", "CONTROL_MAX_BYTES", "HWM", "LOOPBACK_HOSTS", "MAX_EVENTS", "MAX_MESSAGES_PER_WAKE",
    "MAX_WARNED_PEERS", "POLL_MS", "Event", "IncomingBatch", "PeerClosed", "PeerStatus", "PeerTimeout",
    "RolloutReceiver", "RolloutSender", "TransportError", "check_bind_address",
]
