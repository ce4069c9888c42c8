"""Partial rollouts (issue 45; ``decoupled.partial_rollouts``) without processes: the carry-over's bookkeeping
(whole groups only, a row's budget and end, stale groups started over), rows continued across rounds by the lean
engine with each token's version and log-prob, the trainer's filter of groups trained already, and the config's
refusals. A trainer killed and resumed with partial rollouts: tests/integration/test_partial_rollouts_run.py."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.decoupled.carry_over import ALL_GROUPS_TRAINED, CarryOver, group_id
from grpo.decoupled.partial_rollouts import advance, groups_generation
from grpo.models.tiny import build_qwen2
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.lean import LeanEngine

EOS = 99


def opened(G: int = 2, max_tokens: int = 10, budget: int = 4, min_new: int = 0, prompts: int = 2) -> CarryOver:
    carry = CarryOver(G, max_tokens, budget, min_new)
    carry.start("step-1/rank-0", list(range(prompts)), [[1, 2]] * prompts, ["p"] * prompts)
    return carry


def test_a_group_is_sent_only_when_all_its_rows_have_ended():
    carry = opened()
    first, second = carry.groups
    assert [g.group_id for g in carry.groups] == [group_id("step-1/rank-0", 0), "step-1/rank-0#1"]
    carry.extend(first, 0, [5, EOS], [0, 0], [-1.0, -2.0], eos=True)
    carry.extend(second, 0, [5, EOS], [0, 0], [-1.0, -2.0], eos=True)
    carry.extend(second, 1, [6, 7, 8, 9], [0, 0, 0, 0], [-1.0] * 4, eos=False)  # still running after the budget
    assert carry.take_finished() == [] and len(carry.groups) == 2
    carry.start("step-1/rank-0", [0, 1], [[1, 2]] * 2, ["p"] * 2)  # the chunk made again: its open groups stay
    assert len(carry.groups) == 2 and carry.groups[1].rows[1].tokens == [6, 7, 8, 9]
    carry.extend(first, 1, [3, EOS], [1, 1], [-0.5, -0.5], eos=True)
    assert [g.group_id for g in carry.take_finished()] == ["step-1/rank-0#0"]
    assert [g.group_id for g in carry.groups] == ["step-1/rank-0#1"]
    (call,) = carry.calls()  # the running row continues from its 4 tokens, for the budget
    assert (call.max_tokens, call.min_new_tokens, [j for _, j in call.rows]) == (4, 0, [1])


def test_rows_of_any_length_share_a_call_and_min_new_tokens_alone_splits_them():
    # a call's EOS-free tokens are at most its own (vLLM refuses min_tokens > max_tokens): 6 left is 4 of a budget of 4
    carry = opened(G=2, max_tokens=10, budget=4, min_new=6, prompts=1)
    (group,) = carry.groups
    assert [(c.max_tokens, c.min_new_tokens, len(c.rows)) for c in carry.calls()] == [(4, 4, 2)]
    carry.extend(group, 0, [5] * 4, [0] * 4, [-1.0] * 4, eos=False)
    assert [(c.min_new_tokens, [j for _, j in c.rows]) for c in carry.calls()] == [(2, [0]), (4, [1])]
    carry.extend(group, 0, [5] * 4, [1] * 4, [-1.0] * 4, eos=False)
    assert [(c.min_new_tokens, [j for _, j in c.rows]) for c in carry.calls()] == [(0, [0]), (4, [1])]
    # row 0 has 8 tokens, room for 2: of 4 drawn it keeps 2 and ends, cut at the completion's end (truncated)
    carry.extend(group, 0, [5, 6, 7, EOS], [2] * 4, [-1.0, -2.0, -3.0, -4.0], eos=True)
    assert group.rows[0].ended and not group.rows[0].eos
    assert group.rows[0].tokens[-2:] == [5, 6] and group.rows[0].logprobs[-2:] == [-1.0, -2.0]
    assert len(group.rows[0].versions) == 10
    with pytest.raises(ValueError, match="has ended already"):
        carry.extend(group, 0, [5], [2], [-1.0], eos=True)
    with pytest.raises(ValueError, match="1 tokens, 2 versions"):
        carry.extend(group, 1, [5], [2, 2], [-1.0], eos=True)
    carry.extend(group, 1, [5, EOS], [2, 2], [-1.0, -1.0], eos=True)
    assert group.rows[1].eos and carry.calls() == [] and carry.take_finished() == [group]


def test_groups_not_started_yet_share_one_prefill_per_prompt():
    carry = opened(G=3, prompts=2)
    (call,) = carry.calls()
    assert call.per_prompt == 3 and [(g.group_id[-1], j) for g, j in call.rows] == [
        ("0", 0), ("0", 1), ("0", 2), ("1", 0), ("1", 1), ("1", 2)]
    carry.extend(carry.groups[0], 1, [5], [0], [-1.0], eos=False)  # group 0 started: its rows go one by one
    fresh, started = carry.calls()
    assert (fresh.per_prompt, [g.group_id[-1] for g, _ in fresh.rows]) == (3, ["1", "1", "1"])
    assert (started.per_prompt, [j for _, j in started.rows]) == (1, [0, 1, 2])


def test_a_group_with_a_token_older_than_the_chunk_allows_starts_over():
    carry = opened(prompts=2)
    old, new = carry.groups
    carry.extend(old, 0, [5, 6], [3, 4], [-1.0, -1.0], eos=False)
    carry.extend(new, 0, [5, 6], [4, 4], [-1.0, -1.0], eos=False)
    assert old.oldest_version() == 3 and new.oldest_version() == 4
    assert carry.restart_stale(min_version=4) == ["step-1/rank-0#0"]
    assert all(r.tokens == [] and not r.ended for r in old.rows) and new.rows[0].tokens == [5, 6]
    assert carry.restart_stale(min_version=4) == []  # no token left to be stale


def test_a_sent_group_is_kept_until_its_chunk_is_trained_and_starts_over_when_the_trainer_drops_it():
    carry = opened(G=1, prompts=2)
    for group in carry.groups:
        carry.extend(group, 0, [5, EOS], [0, 0], [-1.0, -1.0], eos=True)
    carry.sent("step-1/rank-0", carry.take_finished())
    assert carry.groups == [] and carry.settle([], []) == []
    assert carry.settle([], ["step-1/rank-0"]) == ["step-1/rank-0#0", "step-1/rank-0#1"]  # dropped: made again
    assert [(g.group_id, g.rows[0].tokens, g.prompt_ids) for g in carry.groups] == [
        ("step-1/rank-0#0", [], [1, 2]), ("step-1/rank-0#1", [], [1, 2])]
    assert carry.settle([], ["step-1/rank-0"]) == []  # a verdict counts once
    for group in carry.groups:
        carry.extend(group, 0, [6, EOS], [1, 1], [-1.0, -1.0], eos=True)
    carry.sent("step-2/rank-0", carry.take_finished())
    assert carry.settle(["step-2/rank-0"], []) == [] and carry.unsettled == {}  # trained and checkpointed: gone
    carry.start("step-3/rank-0", [0], [[1, 2]], ["p"])
    carry.sent("step-3/rank-0", list(carry.groups))  # a (pretend) copy still open here: not opened twice
    assert carry.settle([], ["step-3/rank-0"]) == [] and len(carry.groups) == 1


@pytest.fixture(scope="module")
def tiny_engine(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
    version = {"now": 0}
    engine = in_flight_engine(LeanEngine(model, tiny_tokenizer), InFlight(1000, lambda: version["now"]),
                              tiny_tokenizer, "hf", setting="decoupled.partial_rollouts is true")
    return model, engine, version


def test_rows_continued_over_rounds_keep_each_tokens_version_and_the_models_logprob(tiny_tokenizer, tiny_engine):
    model, engine, version = tiny_engine
    temperature, budget, max_tokens = 1.3, 3, 11
    carry = CarryOver(3, max_tokens, budget)
    prompts = ["1+1=", "9-4="]
    ids = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    carry.start("step-2/rank-0", [0, 1], ids, prompts)
    params = SamplingParams(n=3, max_tokens=max_tokens, temperature=temperature)
    rounds = 0
    while carry.groups:
        version["now"] = rounds  # newer weights' version at every round (the weights themselves stay)
        advance(engine, carry, params, seed=7 + rounds)
        for group in carry.groups:
            for row in group.rows:
                assert row.ended or len(row.tokens) == budget * (rounds + 1)  # a running row got the whole budget
        assert len(carry.calls()) <= 1  # every started row in one call (no min_new_tokens, no group left to start)
        finished = carry.take_finished()
        rounds += 1
        for group in finished:
            for row in group.rows:
                assert row.versions == [t // budget for t in range(len(row.tokens))]  # the round that drew each
                assert 1 <= len(row.tokens) <= max_tokens and (row.eos or len(row.tokens) == max_tokens)
                # every token's log-prob is the model's over the prompt and the tokens before it
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([group.prompt_ids + row.tokens])).logits[0]
                start = len(group.prompt_ids) - 1
                want = torch.log_softmax(logits[start:start + len(row.tokens)].float() / temperature, -1)
                want = want.gather(-1, torch.tensor(row.tokens)[:, None]).squeeze(-1)
                assert torch.allclose(torch.tensor(row.logprobs), want, atol=1e-5)
        assert rounds <= -(-max_tokens // budget)
    assert rounds > 1  # some row ran over a round: something was carried


def test_finished_groups_make_one_generation_with_their_versions_and_logprobs(tiny_tokenizer, tiny_engine):
    model, engine, _ = tiny_engine
    eos = eos_token_ids(model, tiny_tokenizer)
    carry = CarryOver(2, 6, 3)
    carry.start("step-1/rank-0", [0], [[5, 6, 7]], ["x"])
    (group,) = carry.groups
    carry.extend(group, 0, [11, eos[0]], [2, 2], [-0.1, -0.2], eos=True)
    carry.extend(group, 1, [12, 13, 14], [1, 1, 1], [-0.3, -0.4, -0.5], eos=False)
    carry.extend(group, 1, [15, 16, 17], [2, 2, 2], [-0.6, -0.7, -0.8], eos=False)
    gen = groups_generation(carry.take_finished(), tiny_tokenizer, eos)
    assert gen.completion_ids.tolist() == [[11, eos[0]] + [tiny_tokenizer.pad_token_id] * 4, [12, 13, 14, 15, 16, 17]]
    assert gen.completion_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1] * 6] and gen.truncated.tolist() == [False, True]
    assert gen.token_versions.tolist() == [[2, 2, 0, 0, 0, 0], [1, 1, 1, 2, 2, 2]]
    assert gen.sampler_logprobs[1].tolist() == pytest.approx([-0.3, -0.4, -0.5, -0.6, -0.7, -0.8])
    assert gen.prompt_ids.tolist() == [[5, 6, 7]] * 2


def test_the_trainer_trains_no_group_twice():
    from step_helpers import random_batch

    from grpo.decoupled.trainer_role import untrained_part
    from grpo.decoupled.transport import IncomingBatch

    batch = random_batch(vocab=50, N=6)  # 3 groups of 2
    groups = ["step-1/rank-0#0", "step-1/rank-0#1", "step-2/rank-0#0"]
    incoming = IncomingBatch("step-2/rank-0", "sampler-0", 1, batch, {"groups": groups}, 0.0)
    assert untrained_part(incoming, set()) is incoming
    part = untrained_part(incoming, {"step-1/rank-0#1"})
    assert part.meta["groups"] == ["step-1/rank-0#0", "step-2/rank-0#0"]
    assert torch.equal(part.batch.rewards, batch.rewards[[0, 1, 4, 5]])
    assert untrained_part(incoming, set(groups)) is None
    plain = IncomingBatch("step-2/rank-0", "sampler-0", 1, batch, {}, 0.0)  # not a partial chunk: as it is
    assert untrained_part(plain, set(groups)) is plain


PARTIAL = ["train.mode=decoupled", "decoupled.partial_rollouts=true", "train.max_staleness=1",
           "rollout.max_completion_length=64"]


@pytest.mark.parametrize("overrides, match", [
    (["decoupled.partial_rollouts=true"], "train.mode is colocated"),
    ([*PARTIAL, "rollout.engine=vllm", "rollout.top_p=0.9"], "rollout.engine is vllm with rollout.top_p 0.9"),
    ([*PARTIAL, "rollout.engine=vllm", "rollout.top_k=20"], "top_k 20 and loss.sampler_is_correction off"),
    ([*PARTIAL, "rollout.engine=hf-generate"], "rollout.engine is hf-generate"),
    ([*PARTIAL, "train.max_staleness=0", "train.sync_steps=1"], "train.max_staleness is 0"),
    ([*PARTIAL, "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling is on"),
    ([*PARTIAL, "decoupled.partial_token_budget=64"], "not below rollout.max_completion_length 64"),
])
def test_the_config_refuses_what_cannot_carry_a_rollout_over(overrides, match):
    with pytest.raises(ConfigError, match=f"decoupled.partial_rollouts.*{match}"):
        load_config(None, overrides)


def test_the_config_takes_partial_rollouts_with_and_without_in_flight_updates():
    cfg = load_config(None, [*PARTIAL, "rollout.engine=hf", "decoupled.partial_token_budget=16"])
    assert (cfg.decoupled.partial_rollouts, cfg.decoupled.partial_token_budget) == (True, 16)
    cfg = load_config(None, [*PARTIAL, "rollout.engine=hf", "decoupled.weight_update=in_flight"])
    assert cfg.decoupled.weight_update == "in_flight" and cfg.decoupled.partial_rollouts
    cfg = load_config(None, [*PARTIAL, "rollout.engine=hf-static", "decoupled.weight_update=in_flight"])
    assert cfg.rollout.engine == "hf-static" and cfg.decoupled.partial_rollouts  # the static step records too
    cfg = load_config(None, [*PARTIAL, "rollout.engine=hf", "model.lora_r=8"])  # per-token records with LoRA too
    assert cfg.decoupled.partial_rollouts and cfg.model.lora_r == 8
    cfg = load_config(None, [*PARTIAL, "rollout.engine=vllm"])  # vLLM's processed log-probs, top-k/top-p off
    assert cfg.rollout.engine == "vllm" and cfg.decoupled.partial_rollouts
    # truncated sampling with the correction on: vLLM's log-probs are the importance weight's sampling probabilities
    cfg = load_config(None, [*PARTIAL, "rollout.engine=vllm", "rollout.top_p=0.9", "loss.sampler_is_correction=true",
                             "rollout.vllm_check_steps=0"])
    assert cfg.rollout.top_p == 0.9 and cfg.decoupled.partial_rollouts
    assert not load_config(None, []).decoupled.partial_rollouts
    cfg = load_config(None, [*PARTIAL, "rollout.engine=hf", "decoupled.trainer_ranks=2", "train.prompts_per_step=4"])
    assert cfg.decoupled.trainer_ranks == 2  # torch/DDP ranks split a step's groups unevenly


@pytest.mark.parametrize("overrides, uneven, padded", [
    ([*PARTIAL, "decoupled.trainer_ranks=2", "train.prompts_per_step=4"], True, False),  # DDP meets once: no padding
    ([*PARTIAL, "decoupled.trainer_ranks=2", "train.prompts_per_step=4", "train.deepspeed=configs/ds_zero2.json"],
     True, True),
    ([*PARTIAL, "train.deepspeed=configs/ds_zero3.json"], False, False),  # one rank: nothing to match
    (["train.mode=decoupled", "decoupled.trainer_ranks=2", "train.prompts_per_step=4",
      "train.deepspeed=configs/ds_zero2.json"], False, False),  # even steps: ordinary runs change nothing
])
def test_deepspeed_ranks_with_partial_rollouts_run_as_many_micro_batches_as_the_most(overrides, uneven, padded):
    from grpo.training.settings import loss_settings

    settings = loss_settings(load_config(None, [*overrides, "rollout.engine=hf"]), None, "cpu")
    assert (settings.uneven_ranks, settings.equal_micro_batches) == (uneven, padded)


def test_a_held_chunk_loses_the_groups_trained_since_it_came():
    # A group made twice (its chunk made again elsewhere) may sit in a chunk that came early; by its step the other
    # copy may be trained: the check is made again then, and a chunk left with nothing is made again.
    from step_helpers import random_batch

    from grpo.decoupled.link_settings import ReceivingSettings
    from grpo.decoupled.trainer_role import step_chunks
    from grpo.decoupled.transport import IncomingBatch
    from grpo.decoupled.work_plan import Chunk

    class Receiver:
        def __init__(self):
            self.dropped = []

        def drop(self, batch_id, reason, final=True):
            self.dropped.append((batch_id, reason, final))

        def next_batch(self, timeout_s):
            return IncomingBatch("step-3/rank-0", "sampler-0", 2, random_batch(vocab=50, N=2), {"groups": ["c#0"]}, 0.0)

    groups = ["a#0", "b#0", "b#1"]
    held = {Chunk(3, 0): IncomingBatch("step-3/rank-0", "sampler-1", 2, random_batch(vocab=50, N=6),
                                       {"groups": groups}, 0.0)}
    settings = ReceivingSettings(trainer_ranks=1, max_staleness=1, peer_timeout_s=60, sync_steps=1, weights_keep=1,
                                 max_message_bytes=1 << 20)
    receiver = Receiver()
    (chunk,), _ = step_chunks(receiver, 3, settings, dict(held), None, trained_groups={"b#0"})
    assert chunk.meta["groups"] == ["a#0", "b#1"] and receiver.dropped == []
    (chunk,), _ = step_chunks(receiver, 3, settings, dict(held), None, trained_groups=set(groups))
    assert receiver.dropped == [("step-3/rank-0", ALL_GROUPS_TRAINED, False)]
    assert chunk.meta["groups"] == ["c#0"]  # the chunk made again


def test_the_sampler_reads_each_verdict_once_and_makes_no_group_trained_elsewhere_again():
    from types import SimpleNamespace

    from grpo.decoupled.sampler_role import Settlements

    sender = SimpleNamespace(acked=["step-1/rank-0"], dropped=[("step-2/rank-0", "stale: made with version 0")])
    seen = Settlements()
    assert seen.new(sender) == (["step-1/rank-0"], ["step-2/rank-0"])
    assert seen.new(sender) == ([], [])
    sender.acked.append("step-3/rank-0")
    sender.dropped.append(("step-4/rank-0", ALL_GROUPS_TRAINED))
    assert seen.new(sender) == (["step-3/rank-0"], [])
