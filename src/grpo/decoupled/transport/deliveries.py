"""What the transport endpoints hand their callers: typed records, no logic."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.step.records import RolloutBatch


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


@dataclass(frozen=True)
class Event:
    """Something the trainer told this sampler: kind (welcome, ack, dropped, busy, weights, error, bye)
    and the message's header fields."""

    kind: str
    header: dict
