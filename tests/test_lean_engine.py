"""The lean sampling loop draws from the same distribution as generate(), and greedy decoding agrees."""

from __future__ import annotations

import pytest
import torch
from step_helpers import chat

from grpo.models.tiny import build_qwen2
from grpo.rollout import HFEngine, SamplingParams
from grpo.rollout.lean import LeanEngine, draw_tokens, filter_logits
from grpo.step.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, seed=3).eval()


def test_greedy_equals_generate(model, tiny_tokenizer):
    # Prompts of different lengths (left padding), several samples each, some rows finishing early:
    # token-for-token the same as HF generate.
    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "Tom has 12 apples and buys 7 more apples.")]
    params = SamplingParams(n=1, max_tokens=20, greedy=True)
    lean = LeanEngine(model, tiny_tokenizer).generate(prompts, params)
    ref = HFEngine(model, tiny_tokenizer).generate(prompts, params)
    assert torch.equal(lean.completion_ids, ref.completion_ids[:, : lean.completion_ids.shape[1]])
    assert torch.equal(lean.completion_mask, ref.completion_mask[:, : lean.completion_mask.shape[1]])


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (20, 0.9)])
def test_filter_matches_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    expected = warpers(None, logits.clone())
    got = filter_logits(logits, 0.8, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_samples_follow_the_model_distribution(model, tiny_tokenizer):
    # 4000 samples of one prompt with top_k=5: the empirical first-token frequencies match the
    # distribution transformers' own warpers define (temperature then top-k). Over 5 tokens the
    # sampling noise in total variation is ~0.01; a missing temperature or filter moves it by > 0.05.
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    prompt = chat(tiny_tokenizer, "What is 2 + 2?")
    T, n = 0.7, 4000
    gen = LeanEngine(model, tiny_tokenizer).generate(
        [prompt], SamplingParams(n=n, max_tokens=3, temperature=T, top_k=5), seed=1)
    ids = tiny_tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
    probs = torch.softmax(TopKLogitsWarper(5)(None, TemperatureLogitsWarper(T)(None, logits)), -1)[0]
    counts = torch.bincount(gen.completion_ids[:, 0], minlength=probs.numel()).float()
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    assert tv < 0.03, tv
    lp = completion_logprobs(model, gen.prompt_ids[:50], gen.prompt_mask[:50], gen.completion_ids[:50],
                             gen.completion_mask[:50], T)
    assert torch.isfinite(lp).all()


def test_inverse_cdf_draws_follow_the_probabilities_and_skip_zeros():
    # Three distributions over 40 tokens: top-k style (zeros, including the first and last token),
    # peaked, uniform. 20000 draws each: the total variation from the probabilities is sampling noise
    # (~0.02 at most here; an off-by-one in the CDF search moves it by far more), and a token of
    # probability zero is never drawn.
    V, n = 40, 20000
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[0, :] = float("-inf")
    logits[0, 5:12] = torch.randn(7, generator=torch.Generator().manual_seed(1))
    logits[1] *= 4
    logits[2] = 0.0
    probs = logits.softmax(-1)  # [3, V]
    draws = draw_tokens(probs.repeat_interleave(n, 0), torch.Generator().manual_seed(2)).view(3, n)
    for row in range(3):
        freq = torch.bincount(draws[row], minlength=V).float() / n
        assert 0.5 * (freq - probs[row]).abs().sum() < 0.03, row
        assert torch.all(freq[probs[row] == 0] == 0)


def test_same_seed_same_samples(model, tiny_tokenizer):
    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "Sara has 4 pens.")]
    a = LeanEngine(model, tiny_tokenizer).generate(prompts, SamplingParams(n=4, max_tokens=12), seed=7)
    b = LeanEngine(model, tiny_tokenizer).generate(prompts, SamplingParams(n=4, max_tokens=12), seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_lora_policy_samples_with_the_adapter_folded_in(model, tiny_tokenizer):
    # A LoRA policy with non-zero adapters: the folded-weight sampling equals generate() on the peft
    # model (greedy, token for token), and the base weights are untouched afterwards.
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    base_before = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items() if "lora" not in k}
    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "Tom has 12 apples and buys 7 more apples.")]
    params = SamplingParams(n=1, max_tokens=16, greedy=True)
    lean = LeanEngine(peft_model, tiny_tokenizer).generate(prompts, params)
    ref = HFEngine(peft_model, tiny_tokenizer).generate(prompts, params)
    plain = LeanEngine(model, tiny_tokenizer).generate(prompts, params)
    assert torch.equal(lean.completion_ids, ref.completion_ids[:, : lean.completion_ids.shape[1]])
    assert not torch.equal(lean.completion_ids, plain.completion_ids[:, : lean.completion_ids.shape[1]])
    after = peft_model.get_base_model().state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base_before.items())


def test_sliding_window_layers_keep_their_own_cache(tiny_tokenizer):
    # A model with sliding-window attention: its cache layers drop old positions, so they are repeated
    # as they are instead of being replaced by the preallocated layer; greedy still equals generate.
    from grpo.models.tiny import build_qwen2

    model = build_qwen2(tiny_tokenizer, seed=3)
    model.config.use_sliding_window, model.config.sliding_window = True, 8
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model = type(model)(model.config).eval()
    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "Tom has 12 apples and buys 7 more apples.")]
    params = SamplingParams(n=1, max_tokens=12, greedy=True)  # generate() refuses n > 1 when greedy
    lean = LeanEngine(model, tiny_tokenizer).generate(prompts, params)
    ref = HFEngine(model, tiny_tokenizer).generate(prompts, params)
    assert torch.equal(lean.completion_ids, ref.completion_ids[:, : lean.completion_ids.shape[1]])
