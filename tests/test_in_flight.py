"""Weights updated during generation (issue 45, part 2; ``decoupled.weight_update: in_flight``): the lean engine
that loads version v+1 mid-sequence draws exactly the tokens of a plain reference loop that swaps the weights at the
same token (the KV cache kept), records each token's version and log-prob, and the config refuses what it cannot
update in flight. LoRA adapters loaded in flight: tests/test_in_flight_lora.py."""

from __future__ import annotations

import pytest
import torch
from in_flight_helpers import SEED, TEMPERATURE, Publisher, reference_loop

from grpo.config import ConfigError, load_config
from grpo.models.tiny import build_qwen2
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.hf import HFEngine
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.lean import LeanEngine


@pytest.mark.parametrize("check_tokens, load_on", [(4, 2), (3, 3), (5, 1)])
def test_a_version_loaded_mid_sequence_gives_the_reference_loops_tokens(tiny_tokenizer, check_tokens, load_on):
    # load_on 2: the engine asks at the prefill (call 1), then after every check_tokens tokens; the newer weights
    # arrive at call load_on, so they make every token from (load_on - 1) * check_tokens on. load_on 1: at the prefill.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).eval()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    newer = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=1).state_dict()
    prompt = tiny_tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    max_tokens, swap_after = 14, (load_on - 1) * check_tokens
    publisher = Publisher(lambda: model.load_state_dict(newer), load_on)
    engine = LeanEngine(model, tiny_tokenizer)
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=TEMPERATURE)
    got = engine.generate_in_flight([prompt], params, SEED, InFlight(check_tokens, publisher.refresh))

    model.load_state_dict(initial)
    eos = eos_token_ids(model, tiny_tokenizer)
    if swap_after == 0:
        model.load_state_dict(newer)
    tokens, logprobs = reference_loop(model, prompt, lambda: model.load_state_dict(newer),
                                      swap_after if swap_after else -1, max_tokens, eos)
    n = int(got.completion_mask.sum())
    assert got.completion_ids[0, :n].tolist() == tokens
    assert n > swap_after, "the row ended before the swap: pick another prompt or seed"
    assert got.token_versions[0, :n].tolist() == [0] * swap_after + [1] * (n - swap_after)
    assert torch.allclose(got.sampler_logprobs[0, :n], torch.tensor(logprobs), atol=1e-5)
    # the reference without the swap draws other tokens: the test sees the new weights
    model.load_state_dict(initial)
    unchanged, _ = reference_loop(model, prompt, lambda: None, -1, max_tokens, eos)
    if swap_after < n - 1:
        assert unchanged != tokens


def test_every_row_switches_at_the_same_token_and_the_calls_follow_check_tokens(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
    newer = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=1).state_dict()
    publisher = Publisher(lambda: model.load_state_dict(newer), load_on=3)
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("1+1=", "22*3=")]
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0)
    got = LeanEngine(model, tiny_tokenizer).generate_in_flight(prompts, params, SEED, InFlight(2, publisher.refresh))
    mask = got.completion_mask.bool()
    want = (torch.arange(got.completion_ids.shape[1]) >= 4).long().expand_as(mask) * mask  # calls after tokens 1, 3
    assert torch.equal(got.token_versions, want)
    assert publisher.calls == 1 + (got.completion_ids.shape[1] - 1) // 2  # the prefill's, then every 2 tokens
    assert bool((got.sampler_logprobs[mask] < 0).all()) and bool((got.sampler_logprobs[~mask] == 0).all())


def test_without_updates_the_in_flight_engine_draws_the_plain_engines_tokens(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
    prompts = ["1+1=", "9-4="]
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0)
    plain = LeanEngine(model, tiny_tokenizer).generate(prompts, params, seed=SEED)
    live = in_flight_engine(LeanEngine(model, tiny_tokenizer), InFlight(3, lambda: 7), tiny_tokenizer, "hf")
    got = live.generate(prompts, params, seed=SEED)
    assert torch.equal(got.completion_ids, plain.completion_ids) and plain.token_versions is None
    assert torch.equal(got.token_versions, 7 * got.completion_mask)
    with pytest.raises(ConfigError, match="engine is hf-generate .*does not load weights between decode steps"):
        in_flight_engine(HFEngine(model, tiny_tokenizer), InFlight(3, lambda: 0), tiny_tokenizer, "hf-generate")


DECOUPLED = ["train.mode=decoupled", "decoupled.weight_update=in_flight"]


@pytest.mark.parametrize("overrides, match", [
    (["decoupled.weight_update=in_flight"], "train.mode is colocated"),
    ([*DECOUPLED, "rollout.engine=vllm", "rollout.top_p=0.9"], "rollout.engine is vllm with rollout.top_p 0.9"),
    ([*DECOUPLED, "rollout.engine=vllm", "rollout.top_k=20"], "renormalised over the kept tokens.*"
                                                                "set loss.sampler_is_correction: true"),
    ([*DECOUPLED, "rollout.engine=hf-generate"], "rollout.engine is hf-generate"),
    ([*DECOUPLED, "rollout.min_p=0.1"], "rollout.min_p is 0.1"),
])
def test_the_config_refuses_what_cannot_update_in_flight(overrides, match):
    with pytest.raises(ConfigError, match=f"decoupled.weight_update.*{match}"):
        load_config(None, overrides)


def test_the_config_takes_in_flight_with_the_lean_engine():
    cfg = load_config(None, [*DECOUPLED, "rollout.engine=hf", "decoupled.inflight_check_tokens=4"])
    assert (cfg.decoupled.weight_update, cfg.decoupled.inflight_check_tokens) == ("in_flight", 4)
    cfg = load_config(None, [*DECOUPLED, "rollout.engine=hf", "model.lora_r=8"])  # the fold follows the adapter
    assert (cfg.decoupled.weight_update, cfg.model.lora_r) == ("in_flight", 8)
    assert load_config(None, []).decoupled.weight_update == "per_chunk"
    cfg = load_config(None, [*DECOUPLED, "rollout.engine=vllm"])  # full weights reloaded between vLLM's steps
    assert (cfg.decoupled.weight_update, cfg.rollout.engine) == ("in_flight", "vllm")
    cfg = load_config(None, [*DECOUPLED, "rollout.engine=vllm", "model.lora_r=8"])  # open rows re-admitted
    assert (cfg.decoupled.weight_update, cfg.model.lora_r) == ("in_flight", 8)
    cfg = load_config(None, [*DECOUPLED, "rollout.engine=vllm", "rollout.top_k=20", "loss.sampler_is_correction=true",
                             "rollout.vllm_check_steps=0"])  # the truncation goes to the importance weight
    assert (cfg.decoupled.weight_update, cfg.rollout.top_k) == ("in_flight", 20)


def test_in_flight_the_engines_per_token_logprobs_are_the_samplers():
    # A pass after generating would take every log-prob at the last weights; the engine's are each token's own.
    from grpo.decoupled.sampler_role import for_correction
    from step_helpers import random_batch

    batch = random_batch(100)
    engine_logprobs = batch.old_logprobs - 0.3
    batch.sampler_logprobs = engine_logprobs
    off = for_correction(batch, correction=False, in_flight=True)
    assert off.old_logprobs is engine_logprobs and off.sampler_logprobs is None
    on = for_correction(batch, correction=True, in_flight=True)
    assert on.old_logprobs is None and on.sampler_logprobs is engine_logprobs
    per_chunk = for_correction(batch, correction=False)
    assert per_chunk.old_logprobs is batch.old_logprobs and per_chunk.sampler_logprobs is None
