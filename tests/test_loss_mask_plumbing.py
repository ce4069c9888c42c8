"""Multi-turn rows (issue 27) through the batch plumbing: concatenation, group selection, rank slices and dynamic
sampling keep each row's ``loss_mask`` and messages with its tokens; the wire carries them (protocol 3, an older
peer refused); the rollout metrics count sampled tokens.

Each row's loss_mask is a function of its token ids (ids divisible by 3 are the environment's), and its first
message quotes its completion text, so alignment after any re-indexing is checked by recomputing them."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.decoupled.wire import PROTOCOL_VERSION, WireError, batch_to_message, decode, encode, message_to_batch
from grpo.step.batching import concat_batches, rank_groups, select_groups
from grpo.step.dynamic_sampling import merge_rounds
from grpo.step.metrics import rollout_metrics
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

G = 2
META = {"batch_id": "s0:0:1", "sampler_id": "s0", "policy_version": 1}


def environment_tokens(ids: torch.Tensor) -> torch.Tensor:
    return ids % 3 == 0


def make_round(tag: str, P: int, Lc: int, multi_turn: bool = True, calls: float = 1.0) -> RolloutBatch:
    N = P * G
    lengths = torch.tensor([1 + (3 * i) % Lc for i in range(N)])
    completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    ids = (torch.arange(N * Lc).view(N, Lc) + 1000 * len(tag)) * completion_mask
    ids[:, 0] = 1  # every row starts with a sampled token
    completions = [f"{tag}:{i}" for i in range(N)]
    return RolloutBatch(
        generation=Generation(
            prompt_ids=torch.full((N, 3), 5), prompt_mask=torch.ones(N, 3, dtype=torch.long), completion_ids=ids,
            completion_mask=completion_mask, truncated=torch.zeros(N, dtype=torch.bool), completions=completions,
            loss_mask=(completion_mask * ~environment_tokens(ids)) if multi_turn else None,
            messages=[[{"role": "assistant", "content": c}, {"role": "tool", "content": "r"}] for c in completions]
            if multi_turn else None,
            rollout_metrics={"tools/calls_per_completion": calls} if multi_turn else {}),
        rewards=torch.arange(N, dtype=torch.float32), reward_parts=torch.zeros(N, 1), reward_names=["r"],
        advantages=torch.zeros(N), old_logprobs=None, ref_logprobs=None, prompts=[f"{tag}:p{p}" for p in range(P)])


def assert_aligned(batch: RolloutBatch) -> None:
    g = batch.generation
    assert g.loss_mask is not None and g.loss_mask.shape == g.completion_mask.shape
    want = g.completion_mask * ~environment_tokens(g.completion_ids)
    for i, text in enumerate(g.completions):
        if g.messages[i][-1]["role"] == "tool":  # a multi-turn row
            assert torch.equal(g.loss_mask[i], want[i]), text
            assert g.messages[i][0]["content"] == text
        else:  # a single-turn row: every completion token sampled
            assert torch.equal(g.loss_mask[i], g.completion_mask[i]), text
            assert g.messages[i] == [{"role": "assistant", "content": text}]


def test_concat_select_and_rank_groups_keep_loss_mask_and_messages_with_their_rows():
    a, b = make_round("a", 2, 5, calls=1.0), make_round("bb", 3, 8, calls=2.0)
    joined = concat_batches([a, b], pad_id=0)
    assert joined.generation.completion_ids.shape == (10, 8)
    assert_aligned(joined)
    # A mean over rows: 4 rows at 1 call, 6 at 2.
    assert joined.generation.rollout_metrics == {"tools/calls_per_completion": (4 * 1.0 + 6 * 2.0) / 10}
    picked = select_groups(joined, [4, 0, 2])
    assert picked.generation.completions == ["bb:4", "bb:5", "a:0", "a:1", "bb:0", "bb:1"]
    assert_aligned(picked)
    for rank in range(5):
        assert_aligned(rank_groups(joined, rank, 5))


def test_a_single_turn_part_joins_with_its_completion_mask_and_text_and_single_turn_stays_none():
    joined = concat_batches([make_round("a", 2, 5), make_round("s", 1, 6, multi_turn=False)], pad_id=0)
    assert_aligned(joined)
    assert joined.generation.rollout_metrics == {"tools/calls_per_completion": 1.0}  # only the part that has it
    single = concat_batches([make_round("s", 1, 6, multi_turn=False), make_round("t", 2, 4, multi_turn=False)], 0)
    g = single.generation
    assert g.loss_mask is None and g.messages is None and g.rollout_metrics == {}
    assert select_groups(single, [1]).generation.loss_mask is None


def test_dynamic_sampling_keeps_the_masks_of_the_groups_it_keeps():
    rounds = [make_round("a", 2, 5, calls=1.0), make_round("bb", 2, 7, calls=3.0)]
    merged = merge_rounds(rounds, [(1, 1), (0, 0), (1, 0)], pad_id=0)
    assert merged.generation.completions == ["bb:2", "bb:3", "a:0", "a:1", "bb:0", "bb:1"]
    assert_aligned(merged)
    # The rollout's metrics describe every round's rows, dropped groups included (as the rewards' metrics).
    assert merged.generation.rollout_metrics == {"tools/calls_per_completion": 2.0}


@pytest.mark.parametrize("multi_turn", [True, False])
def test_the_wire_carries_loss_mask_messages_and_rollout_metrics(multi_turn):
    batch = make_round("a", 2, 6, multi_turn=multi_turn, calls=1.5)
    header, tensors = batch_to_message(batch, META)
    assert ("loss_mask" in tensors) == multi_turn  # None travels as an absent tensor
    received, _ = message_to_batch(decode(encode("batch", header, tensors, token="t"), token="t", max_bytes=1 << 20))
    a, b = batch.generation, received.generation
    if multi_turn:
        assert b.loss_mask.dtype == a.loss_mask.dtype and torch.equal(a.loss_mask, b.loss_mask)
    else:
        assert b.loss_mask is None
    assert (b.messages, b.rollout_metrics) == (a.messages, a.rollout_metrics)
    assert torch.equal(b.sampled_mask, a.sampled_mask)


def test_the_wire_refuses_a_loss_mask_outside_the_completion_and_bad_messages():
    batch = make_round("a", 2, 6)
    g = batch.generation
    g.loss_mask = g.loss_mask.clone()
    g.loss_mask[0, -1] = 1  # row 0 has one completion token: its last column is padding
    with pytest.raises(WireError, match="loss_mask is 1 where completion_mask is 0"):
        batch_to_message(batch, META)
    header, tensors = batch_to_message(make_round("a", 2, 6), META)
    frames = encode("batch", {**header, "messages": header["messages"][:-1]}, tensors)
    with pytest.raises(WireError, match="messages must be null or a list of N=4"):
        message_to_batch(decode(frames, max_bytes=1 << 20))


def test_a_peer_of_an_older_protocol_is_refused_naming_both_versions():
    # Protocol 2 did not know loss_mask: a trainer of it would train on the environment's tokens.
    header, tensors = batch_to_message(make_round("a", 2, 6), META)
    frames = encode("batch", header, tensors)
    old = json.loads(frames[1])
    old["v"] = 2
    with pytest.raises(WireError, match=f"speaks protocol version 2, not this endpoint's version {PROTOCOL_VERSION}"):
        decode([frames[0], json.dumps(old).encode(), frames[2]], max_bytes=1 << 20)


def test_rollout_metrics_count_sampled_tokens_and_per_token_advantages_over_them():
    batch = make_round("a", 2, 6)
    g = batch.generation
    # Per-token advantages (gae) are 0 on the environment's tokens: the mean of |A| is over sampled tokens only.
    batch.advantages = g.loss_mask.float() * 2.0
    m = rollout_metrics(batch, torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), G)
    assert m["completion_length/mean"] == float(g.completion_mask.sum()) / 4
    assert m["sampled_length/mean"] == float(g.loss_mask.sum()) / 4
    assert m["sampled_length/max"] == float(g.loss_mask.sum(1).max())
    assert m["sampled_length/mean"] < m["completion_length/mean"]
    assert m["advantage/abs_mean"] == 2.0
    single = make_round("s", 2, 6, multi_turn=False)
    assert not any(k.startswith("sampled_length") for k in
                   rollout_metrics(single, torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), G))
