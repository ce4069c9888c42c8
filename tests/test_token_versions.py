"""Per-token policy versions (issue 45, part 1): the mismatch and staleness math against loop references and by
hand, the versions through the batching and the wire (protocol 4 on; a peer of protocol 3 refused by name), the
trainer's staleness rule on a chunk's oldest token, and the mismatch and staleness metrics a step logs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from algorithm_references import ragged_mask
from step_helpers import RecordingLearner, random_batch
from transport_helpers import ANY_PORT, WAIT, make_batch, raw_dealer

from grpo.algorithm import mismatch_sums, oldest_version, sampler_importance_weights, token_staleness
from grpo.decoupled.link_settings import ReceivingSettings
from grpo.decoupled.token_versions import chunk_version, stamped, staleness_metrics
from grpo.decoupled.trainer_role import is_fresh, step_chunks
from grpo.decoupled.transport import IncomingBatch, RolloutReceiver
from grpo.decoupled.wire import PROTOCOL_VERSION, WireError, batch_to_message, decode, encode, message_to_batch
from grpo.decoupled.work_plan import Chunk
from grpo.models.tiny import build_qwen2
from grpo.parallel.distributed import DistInfo
from grpo.step.batching import concat_batches, select_groups
from grpo.step.experience import generation_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings

META = {"batch_id": "step-1/rank-0", "sampler_id": "s0", "policy_version": 3}


# ------------------------------------------------------------------------------------------ the math

def ref_mismatch(trainer, sampler, mask, weights=None):
    """Loop reference: k3 summed, the largest ratio, the masked count and the token count, over the masked tokens."""
    k3, ratio_max, masked, tokens = 0.0, 0.0, 0, 0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t]:
                r = trainer[i][t] - sampler[i][t]
                k3 += math.exp(r) - 1 - r
                ratio_max = max(ratio_max, math.exp(r))
                masked += int(weights is not None and weights[i][t] == 0)
                tokens += 1
    return k3, ratio_max, masked, tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode, floor", [(None, None), ("token_mask", 0.8), ("sequence_mask", 0.5),
                                         ("token_truncate", 0.8)])
def test_mismatch_matches_the_loop_reference(seed, mode, floor):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(5, 6, gen)
    trainer = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + 0.6 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    sampler = sampler.masked_fill(mask == 0, float("-inf"))  # padding may hold anything
    weights = (sampler_importance_weights(trainer, sampler, mask, 2.0, mode, floor)[0] if mode else None)
    got = mismatch_sums(trainer, sampler, mask, weights)
    want = ref_mismatch(trainer.tolist(), sampler.tolist(), mask.tolist(), None if weights is None else weights.tolist())
    assert got.k3.item() == pytest.approx(want[0], abs=1e-12)
    assert got.ratio_max.item() == pytest.approx(want[1], rel=1e-12)
    assert (got.masked.item(), got.tokens.item()) == (want[2], want[3])
    if mode in (None, "token_truncate"):
        assert got.masked.item() == 0  # truncation keeps every token in the loss


def test_mismatch_by_hand():
    # r = trainer - sampler: ln 2, 0, -ln 2 on the real tokens; the last column is padding.
    trainer = torch.tensor([[math.log(0.5), -1.0, math.log(0.25), 5.0]])
    sampler = torch.tensor([[math.log(0.25), -1.0, math.log(0.5), -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    got = mismatch_sums(trainer, sampler, mask)
    # k3 = (2 - 1 - ln 2) + 0 + (0.5 - 1 + ln 2) = 0.5; the largest ratio 2 (padding's e^14 not counted)
    assert got.k3.item() == pytest.approx(0.5, abs=1e-6)
    assert got.ratio_max.item() == pytest.approx(2.0, abs=1e-6)
    # IcePop's band [0.6, 1.5] (token_mask with a floor) drops the tokens of ratio 2 and 0.5
    weights, _ = sampler_importance_weights(trainer, sampler, mask, 1.5, "token_mask", 0.6)
    assert mismatch_sums(trainer, sampler, mask, weights).masked.item() == 2
    with pytest.raises(ValueError, match="shape mismatch"):
        mismatch_sums(trainer, sampler[:, :3], mask)
    empty = mismatch_sums(trainer, sampler, torch.zeros_like(mask))
    assert (empty.k3.item(), empty.ratio_max.item(), empty.tokens.item()) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_token_staleness_and_the_oldest_version_match_a_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(4, 5, gen).long()
    versions = torch.randint(2, 9, (4, 5), generator=gen) * mask  # 0 on padding: never read
    behind = [9 - v for row, m in zip(versions.tolist(), mask.tolist()) for v, k in zip(row, m) if k]
    assert token_staleness(versions, mask, 9) == pytest.approx((sum(behind) / len(behind), max(behind)))
    assert oldest_version(versions, mask) == 9 - max(behind)
    assert token_staleness(versions, torch.zeros_like(mask), 9) == (0.0, 0.0)
    assert oldest_version(versions, torch.zeros_like(mask)) is None


# ------------------------------------------------------------------------------------------ the records and the wire

def versioned(batch, versions):
    gen = batch.generation
    return replace(batch, generation=replace(gen, token_versions=torch.as_tensor(versions) * gen.sampled_mask))


def test_stamping_batching_and_the_wire_keep_each_tokens_version():
    batch = make_batch(N=4, G=2, Lc=3)
    batch.generation.completion_mask[1, 2] = 0
    one = stamped(batch, 3)
    assert torch.equal(one.generation.token_versions, 3 * batch.generation.completion_mask)
    assert stamped(one, 7) is one  # versions the engine recorded are kept
    mixed = versioned(batch, [[3, 3, 4], [3, 4, 4], [4, 4, 4], [3, 3, 3]])
    header, tensors = batch_to_message(mixed, META)
    back, meta = message_to_batch(decode(encode("batch", header, tensors), max_bytes=1 << 20))
    assert torch.equal(back.generation.token_versions, mixed.generation.token_versions) and meta["policy_version"] == 3
    joined = concat_batches([mixed, stamped(make_batch(N=2, G=2, Lc=5), 5)], pad_id=0)
    assert joined.generation.token_versions.shape == (6, 5)
    assert torch.equal(joined.generation.token_versions[:4, :3], mixed.generation.token_versions)
    assert torch.equal(select_groups(joined, [2]).generation.token_versions, torch.full((2, 5), 5))
    without = concat_batches([mixed, make_batch(N=2, G=2)], pad_id=0)  # a part without versions: none
    assert without.generation.token_versions is None


def test_the_wire_refuses_negative_versions():
    bad = versioned(make_batch(N=2, G=2, Lc=2), [[1, -1], [1, 1]])
    with pytest.raises(WireError, match="token_versions holds a negative policy version"):
        batch_to_message(bad, META)


@pytest.mark.parametrize("old", [3, 4, 5])
def test_a_sampler_of_an_older_protocol_is_refused_by_name(old):
    # Protocol 3 sent no token versions: its chunks would be judged stale or fresh by their header alone; protocol 4
    # knows no adopted groups (a dead sampler's groups handed to it would be lost: tests/test_orphan_groups.py);
    # protocol 5 carries no recorded routing (a trainer replaying it would find none: tests/test_routing_replay.py).
    assert PROTOCOL_VERSION == 6
    with RolloutReceiver(ANY_PORT, queue_size=4) as receiver:
        with raw_dealer(receiver.address, b"sampler-7") as raw:
            raw.send_multipart([b"", json.dumps({"v": old, "kind": "hello", "sampler_id": "sampler-7",
                                                 "incarnation": 1}).encode(), b""])
            reply = decode(raw.recv_multipart(), max_bytes=1 << 20)
        assert reply.kind == "error"
        assert (f"sampler 'sampler-7' speaks protocol version {old}, not this endpoint's version {PROTOCOL_VERSION}"
                in reply.header["reason"])
        assert receiver.peers() == {} and receiver.stats["rejected"] == 1


# ------------------------------------------------------------------------------------------ the trainer's rule

def incoming(batch, step: int, header_version: int) -> IncomingBatch:
    return IncomingBatch(f"step-{step}/rank-0", "s0", header_version, batch, {}, 0.0)


def test_the_staleness_rule_reads_the_oldest_token():
    batch = make_batch(N=2, G=2, Lc=3)
    mixed = versioned(batch, [[2, 5, 5], [5, 5, 5]])  # one token made by version 2
    assert chunk_version(incoming(mixed, 7, 5)) == 2
    assert not is_fresh(incoming(mixed, 7, 5), Chunk(7, 0), max_staleness=1)  # (7 - 1) - 2 = 4 > 1
    assert is_fresh(incoming(stamped(batch, 5), 7, 5), Chunk(7, 0), max_staleness=1)  # 6 - 5 = 1
    assert is_fresh(incoming(mixed, 7, 5), Chunk(7, 0), max_staleness=4)  # max_staleness keeps its meaning
    assert chunk_version(incoming(batch, 7, 5)) == 5  # no versions on it: its header's


class FakeReceiver:
    """The receiver calls step_chunks makes: hands out ``items`` in order, records drops."""

    def __init__(self, items):
        self.items, self.dropped = list(items), []

    def next_batch(self, timeout_s):
        return self.items.pop(0) if self.items else None

    def drop(self, batch_id, reason, final=True):
        self.dropped.append((batch_id, reason))

    def peers(self):
        return {}


def test_step_chunks_drops_a_chunk_with_a_too_stale_token_and_the_step_logs_token_staleness():
    settings = ReceivingSettings(trainer_ranks=1, max_staleness=1, peer_timeout_s=WAIT, max_message_bytes=1 << 20,
                                 sync_steps=1, weights_keep=1)
    batch = make_batch(N=2, G=2, Lc=3)
    stale = incoming(versioned(batch, [[1, 3, 3], [3, 3, 3]]), 4, 3)
    fresh = incoming(versioned(batch, [[2, 3, 3], [3, 3, 3]]), 4, 3)
    receiver, counts = FakeReceiver([stale, fresh]), SimpleNamespace(dropped=0)
    chunks, _ = step_chunks(receiver, 4, settings, {}, counts)
    assert [c.batch_id for c in chunks] == ["step-4/rank-0"] and counts.dropped == 1
    assert "made with version 1" in receiver.dropped[0][1]
    metrics = staleness_metrics(chunks[0].batch, 3)  # behind version 3: one token by 1, five by 0
    assert metrics == {"staleness/token_mean": pytest.approx(1 / 6), "staleness/token_max": 1.0}


# ------------------------------------------------------------------------------------------ the step's metrics

def loss_settings(**extra) -> LossSettings:
    values = dict(epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="grpo", max_completion_length=7,
                  temperature=0.9, num_iterations=1, micro_batch_size=2, max_grad_norm=None)
    return LossSettings(**{**values, **extra})


@pytest.mark.parametrize("mode", [None, "token_mask"])
def test_the_update_logs_the_mismatch_of_the_samplers_logprobs(tiny_tokenizer, mode):
    # A decoupled batch: the sampler's log-probs differ from the trainer's by a known drift per column.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    gen = batch.generation
    trainer = generation_logprobs(model, gen, 0.9, 64)  # [N, Lc]
    drift = torch.tensor([0.7, -0.7, 2.0, 0.0, -0.7, 0.7, 0.0], dtype=torch.float64)[None].expand(trainer.shape)
    reported = ((trainer.double() - drift) * gen.completion_mask).float().detach()
    if mode is None:  # correction off: the sampler's log-probs travel as old_logprobs
        batch.old_logprobs, batch.sampler_logprobs = reported, None
    else:  # on: as sampler_logprobs, and the trainer takes pi_old itself
        batch.old_logprobs, batch.sampler_logprobs = None, reported
    extra = dict(sampler_is_mode=mode, sampler_is_cap=1.5, sampler_is_min=0.6) if mode else {}
    stats = train_on_batch(RecordingLearner(model), batch, loss_settings(**extra), DistInfo()).totals
    real = gen.completion_mask.bool()
    r = drift[real]
    assert stats["mismatch/k3"] == pytest.approx(float((r.exp() - 1 - r).mean()), abs=1e-5)
    assert stats["mismatch/ratio_max"] == pytest.approx(float(r.exp().max()), rel=1e-5)
    # IcePop's band [0.6, 1.5] drops every token of drift +-0.7 or 2; truncation or no correction drops none
    masked = float((r.abs() > 0.5).double().mean()) if mode == "token_mask" else 0.0
    assert stats["mismatch/masked_fraction"] == pytest.approx(masked, abs=1e-9)


def test_a_colocated_update_logs_no_mismatch(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    batch.old_logprobs = None  # the update's own first pass is pi_old: nothing to compare
    stats = train_on_batch(RecordingLearner(model), batch, loss_settings(), DistInfo()).totals
    assert not [k for k in stats if k.startswith("mismatch/")]
