"""Each sampled token's policy version, as the decoupled roles read and write it: a sampler stamps the tokens an
engine did not stamp itself with the version it sampled with, and the trainer judges a chunk by its oldest token
(``train.max_staleness`` bounds how far behind the oldest token's weights may be)."""

from __future__ import annotations

from dataclasses import replace

from grpo.algorithm import oldest_version, token_staleness
from grpo.decoupled.transport import IncomingBatch
from grpo.step.records import RolloutBatch


def stamped(batch: RolloutBatch, version: int) -> RolloutBatch:
    """``batch`` with every sampled token recorded as made by weights ``version``, unless its engine recorded
    the versions itself (weights loaded mid-generation)."""
    gen = batch.generation
    if gen.token_versions is not None:
        return batch
    versions = gen.sampled_mask.long() * version  # [N, Lc]; 0 on padding and environment tokens
    return replace(batch, generation=replace(gen, token_versions=versions))


def chunk_version(incoming: IncomingBatch) -> int:
    """The version a chunk counts as made with: its oldest sampled token's, else (no versions on it, or no
    sampled token) the one its header names."""
    gen = incoming.batch.generation
    oldest = oldest_version(gen.token_versions, gen.sampled_mask) if gen.token_versions is not None else None
    return incoming.policy_version if oldest is None else oldest


def staleness_metrics(batch: RolloutBatch, version: int) -> dict[str, float]:
    """``staleness/token_mean`` and ``staleness/token_max``: how many versions behind the trainer's weights
    (``version``) the weights that sampled the step's tokens were (``batch`` stamped: ``stamped``)."""
    gen = batch.generation
    if gen.token_versions is None:
        raise ValueError("the batch carries no token versions: stamp its chunks first (stamped)")
    mean, most = token_staleness(gen.token_versions, gen.sampled_mask, version)
    return {"staleness/token_mean": mean, "staleness/token_max": most}
