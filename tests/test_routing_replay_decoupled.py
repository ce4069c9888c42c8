"""Routing replay across the decoupled path (issue 60): a batch's recorded routing crosses the wire exactly and is
checked there; partial rollouts carry each row's routing from round to round, so a row continued over several
rounds holds, at equal weights, the experts a single pass over its whole sequence routes to, and replaying it
gives the sampler's log-probs. A decoupled run with partial rollouts: tests/integration/test_routing_replay_run.py."""

from __future__ import annotations

import pytest
import torch
from architectures import FAMILIES
from step_helpers import random_batch

from grpo.decoupled.carry_over import CarryOver, joined_routing
from grpo.decoupled.partial_rollouts import advance, groups_generation
from grpo.decoupled.wire import WireError, batch_to_message, decode, encode, message_to_batch
from grpo.models.routing_replay import Recording, Replaying, replay_routers
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.lean import LeanEngine

META = {"batch_id": "step-1/rank-0", "sampler_id": "s0", "policy_version": 3}


def _routed(batch, seed: int = 0):
    g = batch.generation
    T = g.prompt_ids.shape[1] + g.completion_ids.shape[1]
    g.routing = torch.randint(-1, 8, (g.prompt_ids.shape[0], T, 3, 2), generator=torch.Generator().manual_seed(seed))
    g.routing = g.routing.to(torch.int16)
    return batch


def test_a_batchs_routing_crosses_the_wire_exactly():
    batch = _routed(random_batch(50, N=4))
    header, tensors = batch_to_message(batch, META)
    back, _ = message_to_batch(decode(encode("batch", header, tensors), max_bytes=1 << 22))
    assert back.generation.routing.dtype == torch.int16
    assert torch.equal(back.generation.routing, batch.generation.routing)
    plain = random_batch(50, N=4)  # not recorded: absent on the wire, None again
    back, _ = message_to_batch(decode(encode("batch", *batch_to_message(plain, META)), max_bytes=1 << 22))
    assert back.generation.routing is None


@pytest.mark.parametrize("bad, words", [
    (lambda r: r[:, 1:], "routing has 11 positions per row, not Lp \\+ Lc = 12"),
    (lambda r: r[:3], "N is 3 here but 4 elsewhere"),
    (lambda r: r - 2, "expert index below -1"),
    (lambda r: r.float(), "routing must be integer"),
])
def test_a_routing_that_does_not_line_up_with_the_batch_is_refused(bad, words):
    batch = _routed(random_batch(50, N=4))
    batch.generation.routing = bad(batch.generation.routing)
    with pytest.raises(WireError, match=words):
        batch_to_message(batch, META)


def test_a_rows_earlier_rounds_keep_their_experts_and_the_new_positions_take_the_calls():
    earlier = torch.tensor([[[1, 2]], [[3, 4]], [[-1, -1]]], dtype=torch.int16)  # [3, layers=1, k=2]: last not fed
    now = torch.tensor([[[5, 6]], [[5, 6]], [[7, 0]], [[2, 3]], [[-1, -1]]], dtype=torch.int16)
    assert joined_routing(earlier, now).tolist() == [[[1, 2]], [[3, 4]], [[7, 0]], [[2, 3]], [[-1, -1]]]
    assert torch.equal(joined_routing(None, now), now)
    with pytest.raises(ValueError, match="does not line up"):
        joined_routing(now, earlier)


@pytest.fixture(scope="module")
def moe(tiny_tokenizer):
    return FAMILIES["qwen3_moe"].build(tiny_tokenizer, seed=0).float().eval()


def test_a_row_carried_over_rounds_holds_the_routing_of_one_pass_and_replays_to_the_samplers_logprobs(
        moe, tiny_tokenizer):
    from grpo.step.logprobs import completion_logprobs

    version = {"now": 0}
    engine = in_flight_engine(LeanEngine(moe, tiny_tokenizer, record_routing=True),
                              InFlight(1000, lambda: version["now"]), tiny_tokenizer, "hf")
    G, budget, max_tokens = 2, 3, 8
    carry = CarryOver(G, max_tokens, budget)
    prompts = ["1+1=", "What is 9-4?"]
    ids = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    carry.start("step-1/rank-0", [0, 1], ids, prompts)
    params = SamplingParams(n=G, max_tokens=max_tokens, temperature=1.0)
    finished, rounds = [], 0
    while carry.groups:
        version["now"] = rounds
        advance(engine, carry, params, seed=11 + rounds)
        finished += carry.take_finished()
        rounds += 1
    assert rounds > 1 and any(len(r.tokens) > budget for g in finished for r in g.rows)  # something was carried
    recording = Recording(moe)
    for group in finished:
        for row in group.rows:
            whole = group.prompt_ids + row.tokens
            assert row.routing.shape == (len(whole), len(replay_routers(moe)), moe.config.num_experts_per_tok)
            fed = (row.routing >= 0).all(-1).all(-1)
            # every position but the last token, which was fed only where the call drew past the row's end
            assert fed[:-1].all() and fed[-1] == (not row.eos and len(row.tokens) % budget != 0)
            with torch.no_grad(), recording.hooks():
                moe(input_ids=torch.tensor([whole]))
            one_pass = recording.take()[fed].sort(-1).values
            assert torch.equal(row.routing[fed].long().sort(-1).values, one_pass)  # equal weights: the same experts

    g = groups_generation(finished, tiny_tokenizer, eos_token_ids(moe, tiny_tokenizer))
    assert g.routing.shape[:2] == (len(finished) * G, g.prompt_ids.shape[1] + g.completion_ids.shape[1])
    replaying = Replaying(moe)
    with torch.no_grad(), replaying.hooks():
        replayed = completion_logprobs(moe, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, 1.0,
                                       routing=g.routing, replaying=replaying)
    mask = g.completion_mask.bool()
    torch.testing.assert_close(replayed[mask], g.sampler_logprobs[mask], rtol=0, atol=1e-5)
    assert replaying.mismatch_fraction() == 0 and replaying.unfed == 0
