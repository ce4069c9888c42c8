"""Partial rollouts keep the carried rows' keys/values between rounds and chunks (issue 45): a carried row feeds its
last token instead of a prefill of its prompt and tokens so far, draws what the prefilled row draws, and the cache
holds only the rows still running. The bookkeeping without keys/values: tests/test_partial_rollouts.py."""

from __future__ import annotations

import pytest
import torch

from grpo.decoupled.carry_over import CarryOver
from grpo.decoupled.partial_rollouts import advance
from grpo.models.tiny import build_qwen2
from grpo.rollout.engine import SamplingParams
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.lean import LeanEngine
from grpo.rollout.prefix_cache import PrefixCache
from grpo.rollout.static import StaticEngine

ENGINES = {"hf": LeanEngine, "hf-static": StaticEngine}
PROMPTS = ["1+1=", "9-4=", "12+30="]


def rounds_of(tokenizer, model, engine_name: str, params: SamplingParams, kept: PrefixCache | None,
              budget: int = 3, max_tokens: int = 14) -> tuple[list, list[int]]:
    """Every group's rows (tokens, log-probs) once all ended, and the cache's entries after each round."""
    engine = in_flight_engine(ENGINES[engine_name](model, tokenizer), InFlight(1000, lambda: 0), tokenizer,
                              engine_name, setting="decoupled.partial_rollouts is true")
    carry = CarryOver(params.n, max_tokens, budget)
    carry.start("step-1/rank-0", list(range(len(PROMPTS))),
                [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS], PROMPTS)
    finished, entries, rounds = [], [], 0
    while carry.groups:
        advance(engine, carry, params, seed=5 + rounds, kept=kept)
        if kept is not None:
            running = sorted(tuple(g.prompt_ids + r.tokens[:-1]) for g in carry.groups for r in g.rows
                             if r.tokens and not r.ended)
            assert sorted(tuple(e.ids) for e in kept.entries) == running, "the cache holds the running rows only"
            entries.append(len(kept.entries))
        finished += carry.take_finished()
        rounds += 1
    rows = sorted((g.group_id, j, r.tokens, r.logprobs) for g in finished for j, r in enumerate(g.rows))
    return rows, entries


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=1).eval()


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_kept_keys_and_values_draw_what_a_prefill_of_the_row_draws(tiny_tokenizer, model, engine_name):
    # greedy: the same tokens with and without the kept cache, their log-probs equal up to the float order of the
    # attention sums; the kept cache fed far fewer prompt tokens
    params = SamplingParams(n=2, max_tokens=14, temperature=0.0)
    plain, _ = rounds_of(tiny_tokenizer, model, engine_name, params, kept=None)
    kept = PrefixCache()
    cached, entries = rounds_of(tiny_tokenizer, model, engine_name, params, kept=kept)
    assert [r[:3] for r in cached] == [r[:3] for r in plain]
    for (_, _, _, got), (_, _, _, want) in zip(cached, plain):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    assert len(entries) > 1 and max(entries) > 0 and entries[-1] == 0, "rows were carried, and none is left"
    assert kept.reused_tokens > 0


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_sampled_rows_record_the_models_logprob_over_their_whole_sequence(tiny_tokenizer, model, engine_name):
    # sampled at temperature 1.3 through kept caches: each token's recorded log-prob is the model's given the prompt
    # and every token before it, recomputed in one plain forward
    temperature = 1.3
    rows, _ = rounds_of(tiny_tokenizer, model, engine_name, SamplingParams(n=3, max_tokens=14,
                                                                           temperature=temperature), PrefixCache())
    prompts = {f"step-1/rank-0#{i}": tiny_tokenizer(p, add_special_tokens=False)["input_ids"]
               for i, p in enumerate(PROMPTS)}
    for gid, _, tokens, logprobs in rows:
        prompt = prompts[gid]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        start = len(prompt) - 1
        want = torch.log_softmax(logits[start:start + len(tokens)].float() / temperature, -1)
        want = want.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-5), gid


def test_retain_keeps_only_the_named_rows():
    cache = PrefixCache()
    cache.entries = [type("E", (), {"ids": ids})() for ids in ([1, 2], [1, 2, 3], [1, 2])]
    cache.retain({(1, 2)})
    assert [e.ids for e in cache.entries] == [[1, 2], [1, 2]]
    cache.clear()
    with pytest.raises(RuntimeError, match="cleared"):
        cache.retain(set())
