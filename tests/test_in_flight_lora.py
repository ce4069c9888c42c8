"""In-flight weight updates for a LoRA policy (issue 45; ``decoupled.weight_update: in_flight`` with
``model.lora_r > 0``): the lean engine samples with the adapter folded into the base weights, and a newer adapter
loaded mid-call (as the sampler loads a published "lora" version: ``SamplerWeights.newest``) is folded again before
the next forward, so the tokens and log-probs are those of a plain peft loop that swaps adapters at the same token."""

from __future__ import annotations

import pytest
import torch
from in_flight_helpers import (SEED, TEMPERATURE, Publisher, lora_policy, published_adapter, reference_loop,
                               sampler_loads, set_adapter)

import grpo.rollout.folded_lora as folded_lora
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.folded_lora import FoldedLora
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.lean import LeanEngine
from grpo.weight_store import apply_to_model


@pytest.mark.parametrize("check_tokens, load_on", [(4, 2), (3, 3), (5, 1)])
def test_an_adapter_loaded_mid_sequence_gives_the_reference_loops_tokens(tiny_tokenizer, tmp_path, check_tokens,
                                                                        load_on):
    # As for full weights (tests/test_in_flight.py): the newer adapter arrives at refresh call load_on, so it makes
    # every token from (load_on - 1) * check_tokens on; the reference is peft's own forward (adapter layers on,
    # nothing folded), the adapter swapped at the same token with the KV cache kept.
    model = lora_policy(tiny_tokenizer)
    store = published_adapter(model, tmp_path, seed=1)
    prompt = tiny_tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    max_tokens, swap_after = 14, (load_on - 1) * check_tokens
    engine = LeanEngine(model, tiny_tokenizer)
    publisher = Publisher(sampler_loads(engine.model, engine, store), load_on)
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=TEMPERATURE)
    got = engine.generate_in_flight([prompt], params, SEED, InFlight(check_tokens, publisher.refresh))
    assert publisher.version == 1

    def load_newer():
        apply_to_model(model, store.load(1))

    eos = eos_token_ids(model, tiny_tokenizer)
    set_adapter(model, 0)
    if swap_after == 0:
        load_newer()
    tokens, logprobs = reference_loop(model, prompt, load_newer, swap_after if swap_after else -1, max_tokens, eos)
    n = int(got.completion_mask.sum())
    assert n > swap_after, "the row ended before the swap: pick another prompt or seed"
    assert got.completion_ids[0, :n].tolist() == tokens
    assert got.token_versions[0, :n].tolist() == [0] * swap_after + [1] * (n - swap_after)
    assert torch.allclose(got.sampler_logprobs[0, :n], torch.tensor(logprobs), atol=1e-5)
    # the reference without the swap draws other tokens: a fold left at v1 would not match the reference above
    set_adapter(model, 0)
    unchanged, _ = reference_loop(model, prompt, lambda: None, -1, max_tokens, eos)
    if swap_after < n - 1:
        assert unchanged != tokens


@torch.no_grad()
def test_the_fold_is_recomputed_when_the_version_changes_and_only_then(tiny_tokenizer, tmp_path, monkeypatch):
    # Fails if refresh() loads the newer adapter without refolding: the swapped-in weights would still be v1's.
    model = lora_policy(tiny_tokenizer)
    store = published_adapter(model, tmp_path, seed=1)
    base = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    x = torch.tensor([tiny_tokenizer("7*8=", add_special_tokens=False)["input_ids"]])
    want_v1 = model(input_ids=x).logits
    folds, fold = [], folded_lora.folded_weight
    monkeypatch.setattr(folded_lora, "folded_weight", lambda layer, w: folds.append(1) or fold(layer, w))
    publisher = Publisher(sampler_loads(model, LeanEngine(model, tiny_tokenizer), store), load_on=3)
    lora = FoldedLora.of(model, InFlight(1, publisher.refresh))  # refresh call 1: version 0, folded once
    layers, in_flight = len(lora.layers), lora.following()
    assert len(folds) == layers
    with lora.swapped():
        assert in_flight.refresh() == 0 and publisher.calls == 1  # the prefill's: call 1 answers it
        assert torch.allclose(model(input_ids=x).logits, want_v1, atol=1e-5)
        assert in_flight.refresh() == 0 and len(folds) == layers  # call 2: no newer version, no new fold
        assert in_flight.refresh() == 1 and len(folds) == 2 * layers  # call 3 loads v2: folded again, in place
        folded_v2 = model(input_ids=x).logits
        assert in_flight.refresh() == 1 and len(folds) == 2 * layers and publisher.calls == 4
    want_v2 = model(input_ids=x).logits  # peft's own forward, with the adapter the sampler loaded
    assert torch.allclose(folded_v2, want_v2, atol=1e-5)
    assert not torch.allclose(want_v2, want_v1, atol=1e-2)
    after = model.get_base_model().state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())  # the base weights were never written


def test_without_updates_a_lora_policy_draws_the_plain_engines_tokens(tiny_tokenizer):
    # Partial rollouts without in-flight updates: the records' version stays the chunk's, nothing is refolded.
    model = lora_policy(tiny_tokenizer)
    prompts = ["1+1=", "9-4="]
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0)
    plain = LeanEngine(model, tiny_tokenizer).generate(prompts, params, seed=SEED)
    live = in_flight_engine(LeanEngine(model, tiny_tokenizer), InFlight(3, lambda: 7), tiny_tokenizer, "hf")
    got = live.generate(prompts, params, seed=SEED)
    assert torch.equal(got.completion_ids, plain.completion_ids)
    assert torch.equal(got.token_versions, 7 * got.completion_mask)
