"""rollout.repetition_penalty / min_new_tokens / min_p in every engine: greedy rows equal HF generate's
token for token (left-padded prompts, so the padding exclusion is checked), draws follow the
distribution transformers' own processors define, min_new_tokens holds every EOS back, the static
engine's step stays free of host syncs, and the vLLM mapping (without vLLM: a stand-in module). Then
end to end: the trainer's log-probs of sampled tokens are the engine's own processed log-probs, and the
update's first pass has ratio 1."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from step_helpers import CountSyncs, RecordingLearner, chat, settings_with

from grpo.algorithm import LogprobProcessing
from grpo.models.tiny import build_qwen2
from grpo.rollout import HFEngine, SamplingParams
from grpo.rollout.lean import LeanEngine
from grpo.rollout.static import StaticEngine
from grpo.step.experience import generation_logprobs
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.step.records import RolloutBatch
from grpo.parallel.distributed import DistInfo

ENGINES = [LeanEngine, StaticEngine, HFEngine]  # hf, hf-static (eager decode_graph on a CPU), hf-generate


def ids_of(tokenizer, text):
    return tokenizer(chat(tokenizer, text), add_special_tokens=False, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def peaked(tiny_tokenizer):
    """The tiny Qwen2 with sharper next-token distributions (untied head x 10: min_p then removes
    tokens) and EOS made a likely first token (its head row 1.02 x that of the prompts' greedy first
    token): without min_new_tokens greedy rows end at once, and the EOS in every chat prompt makes the
    repetition penalty move real mass."""
    model = build_qwen2(tiny_tokenizer, seed=3, tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        first = model(ids_of(tiny_tokenizer, "Hi")).logits[0, -1].argmax()
        model.lm_head.weight[tiny_tokenizer.eos_token_id] = model.lm_head.weight[first] * 1.02
    return model


def prompts_of(tokenizer):
    return [chat(tokenizer, "Hi"), chat(tokenizer, "Tom has 12 apples and buys 7 more apples.")]


@pytest.mark.parametrize("engine_cls", [LeanEngine, StaticEngine])
@pytest.mark.parametrize("controls", [{"repetition_penalty": 1.3}, {"min_new_tokens": 4},
                                      {"repetition_penalty": 1.3, "min_new_tokens": 4}])
def test_greedy_equals_generate(engine_cls, controls, peaked, tiny_tokenizer):
    params = SamplingParams(n=1, max_tokens=12, greedy=True, **controls)
    ours = engine_cls(peaked, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params)
    ref = HFEngine(peaked, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params)
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids, ref.completion_ids[:, :width])
    assert torch.equal(ours.completion_mask, ref.completion_mask[:, :width])
    plain = engine_cls(peaked, tiny_tokenizer).generate(prompts_of(tiny_tokenizer),
                                                        SamplingParams(n=1, max_tokens=12, greedy=True))
    assert plain.completion_ids.shape != ours.completion_ids.shape or not torch.equal(plain.completion_ids,
                                                                                      ours.completion_ids)


def test_generate_config_carries_the_controls():
    on = HFEngine._generation_config(SamplingParams(repetition_penalty=1.2, min_new_tokens=3, min_p=0.05), 0, [2])
    assert (on.repetition_penalty, on.min_new_tokens, on.min_p) == (1.2, 3, 0.05)
    off = HFEngine._generation_config(SamplingParams(), 0, [2])
    assert (off.repetition_penalty, off.min_new_tokens, off.min_p) == (1.0, 0, None)  # no processor at all
    greedy = HFEngine._generation_config(SamplingParams(greedy=True, repetition_penalty=1.2, min_p=0.05), 0, [2])
    assert greedy.repetition_penalty == 1.2 and greedy.min_p is None  # generate: processors, not warpers


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_samples_follow_the_processed_distribution(engine_cls, peaked, tiny_tokenizer):
    # 4000 samples of one prompt at T=0.8 with repetition_penalty 1.5 and min_p 0.1 (5 tokens kept):
    # the first token's frequencies against transformers' processors and warpers in generate's order,
    # then the second token's after the most frequent first one (drawn in the static engine's decode
    # step, with that token now seen). Sampling noise in total variation is ~0.015; dropping the
    # penalty or min_p moves the expected distribution by ~0.38 / 0.40 (checked below).
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
    )

    T, penalty, min_p, n = 0.8, 1.5, 0.1, 4000
    gen = engine_cls(peaked, tiny_tokenizer).generate(
        [chat(tiny_tokenizer, "Hi")],
        SamplingParams(n=n, max_tokens=2, temperature=T, repetition_penalty=penalty, min_p=min_p), seed=1)

    def expected(prefix, penalty=penalty, min_p=min_p):
        with torch.no_grad():
            scores = peaked(prefix).logits[:, -1]
        scores = RepetitionPenaltyLogitsProcessor(penalty)(prefix, scores) if penalty != 1.0 else scores
        scores = TemperatureLogitsWarper(T)(prefix, scores)
        return torch.softmax(MinPLogitsWarper(min_p)(prefix, scores) if min_p else scores, -1)[0]

    ids = ids_of(tiny_tokenizer, "Hi")
    probs = expected(ids)
    assert 0.5 * (probs - expected(ids, penalty=1.0)).abs().sum() > 0.3
    assert 0.5 * (probs - expected(ids, min_p=0.0)).abs().sum() > 0.3
    first = gen.completion_ids[:, 0]
    counts = torch.bincount(first, minlength=probs.numel()).float()
    assert counts[probs == 0].sum() == 0  # min_p's removed tokens are never drawn
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    assert tv < 0.03, tv
    top = torch.bincount(first).argmax()
    assert top.item() != tiny_tokenizer.eos_token_id
    rows = first == top
    probs2 = expected(torch.cat([ids, top.view(1, 1)], 1))
    counts2 = torch.bincount(gen.completion_ids[rows, 1], minlength=probs2.numel()).float()
    assert counts2[probs2 == 0].sum() == 0
    tv2 = 0.5 * (counts2 / rows.sum() - probs2).abs().sum().item()
    assert tv2 < 0.05, (tv2, rows.sum())


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_min_new_tokens_holds_every_eos_back(engine_cls, peaked, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    params = SamplingParams(n=32, max_tokens=8, temperature=1.0)
    free = engine_cls(peaked, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params, seed=3)
    assert (free.completion_ids[:, :4] == eos).any()  # EOS is likely early: the check below can fail
    held = engine_cls(peaked, tiny_tokenizer).generate(
        prompts_of(tiny_tokenizer), SamplingParams(n=32, max_tokens=8, temperature=1.0, min_new_tokens=4), seed=3)
    assert not (held.completion_ids[:, :4] == eos).any()
    assert held.completion_mask[:, :5].all()  # every row has at least 4 tokens before its EOS (or none)


def test_static_step_has_no_host_sync_with_the_controls(peaked, tiny_tokenizer):
    # The processors' state (the seen tokens, the token index against min_new_tokens) lives on the
    # device: the count of would-be syncs over a call does not grow with the number of tokens.
    def syncs(max_tokens):
        engine = StaticEngine(peaked, tiny_tokenizer, eos_check_every=1000)
        params = SamplingParams(n=2, max_tokens=max_tokens, repetition_penalty=1.3, min_new_tokens=3, min_p=0.05)
        counter = CountSyncs()
        with counter:
            engine.generate(prompts_of(tiny_tokenizer), params, seed=0)
        return sum(counter.by_file.values())

    assert syncs(6) == syncs(30)


@pytest.mark.slow
def test_compiled_static_step_with_the_controls_equals_eager(peaked, tiny_tokenizer):
    # fullgraph=True fails on any graph break: the step with the controls is still capturable
    params = SamplingParams(n=2, max_tokens=8, temperature=0.9, repetition_penalty=1.3, min_new_tokens=3, min_p=0.05)
    eager = StaticEngine(peaked, tiny_tokenizer, decode_graph="eager").generate(prompts_of(tiny_tokenizer), params,
                                                                               seed=5)
    compiled = StaticEngine(peaked, tiny_tokenizer, decode_graph="compile").generate(prompts_of(tiny_tokenizer),
                                                                                    params, seed=5)
    assert torch.equal(eager.completion_ids, compiled.completion_ids)


def test_vllm_sampling_params_mapping(monkeypatch):
    # vLLM's SamplingParams fields: repetition_penalty, min_tokens, min_p (a stand-in module records them)
    from grpo.rollout.vllm_engine import TESTED_VLLM, to_vllm_sampling_params

    recorded = {}
    fake = types.SimpleNamespace(__version__=next(iter(TESTED_VLLM)), SamplingParams=lambda **kw: recorded.update(kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    to_vllm_sampling_params(SamplingParams(n=4, temperature=0.9, repetition_penalty=1.2, min_new_tokens=5,
                                           min_p=0.05), seed=1)
    assert (recorded["repetition_penalty"], recorded["min_tokens"], recorded["min_p"]) == (1.2, 5, 0.05)
    to_vllm_sampling_params(SamplingParams(n=1, greedy=True, repetition_penalty=1.2, min_p=0.05), seed=1)
    assert (recorded["repetition_penalty"], recorded["min_p"]) == (1.2, 0.0)  # greedy: the penalty still applies
    to_vllm_sampling_params(SamplingParams(), seed=None)
    assert (recorded["repetition_penalty"], recorded["min_tokens"], recorded["min_p"]) == (1.0, 0, 0.0)


# ---------------------------------------------------------------- the trainer's log-probs follow the sampler

PROCESSING_CASES = [{"repetition_penalty": 1.5}, {"min_new_tokens": 4}, {"min_p": 0.1},
                    {"repetition_penalty": 1.5, "min_new_tokens": 4, "min_p": 0.1}]


def sample_recording_logprobs(model, tokenizer, params, monkeypatch):
    """Sample with the hf engine, recording the engine's own log-prob of each drawn token (the log of the
    probability it drew it with): [N, L] beside the generation. Rows leave the batch as they finish, in
    order, so the rows drawing token t are those whose mask is set at t."""
    import grpo.rollout.lean as lean

    drawn = []
    real_draw = lean.draw_tokens

    def recording_draw(probs, generator):
        tokens = real_draw(probs, generator)
        drawn.append(probs.gather(1, tokens[:, None]).squeeze(1).log())
        return tokens

    monkeypatch.setattr(lean, "draw_tokens", recording_draw)
    gen = LeanEngine(model, tokenizer).generate(prompts_of(tokenizer), params, seed=11)
    engine_logprobs = torch.zeros(gen.completion_ids.shape)
    for t, values in enumerate(drawn):
        engine_logprobs[gen.completion_mask[:, t].bool(), t] = values
    return gen, engine_logprobs


@pytest.mark.parametrize("controls", PROCESSING_CASES)
def test_trainer_logprobs_are_the_engines_processed_logprobs(controls, peaked, tiny_tokenizer, monkeypatch):
    # Sample with each control on, then score the same tokens as the trainer does (completion_logprobs:
    # shared prompt pass, micro-batches, with and without gradients): they equal the engine's log-probs
    # of the distribution it drew from, and differ from the unprocessed ones (so this can fail).
    T = 0.9
    params = SamplingParams(n=6, max_tokens=10, temperature=T, **controls)
    gen, engine_logprobs = sample_recording_logprobs(peaked, tiny_tokenizer, params, monkeypatch)
    mask = gen.completion_mask.bool()
    processing = LogprobProcessing(**controls, eos_ids=(tiny_tokenizer.eos_token_id,))
    args = (peaked, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, T)
    with torch.no_grad():
        trainer = completion_logprobs(*args, micro_batch_size=4, processing=processing)
        plain = completion_logprobs(*args, micro_batch_size=4)
    assert torch.allclose(trainer[mask], engine_logprobs[mask], atol=2e-5, rtol=0)
    assert (plain[mask] - engine_logprobs[mask]).abs().max() > 0.05
    with_grad = completion_logprobs(*args, processing=processing)  # the update's pass: one micro-batch, autograd
    assert with_grad.requires_grad
    assert torch.allclose(with_grad.detach()[mask], trainer[mask], atol=1e-5, rtol=0)


def test_first_pass_ratio_is_one_with_the_controls(peaked, tiny_tokenizer, monkeypatch):
    # The update's first pass recomputes the old log-probs exactly: ratio 1, nothing clipped. Old
    # log-probs taken without the controls (the bug this guards against) give a ratio far from 1.
    controls = PROCESSING_CASES[-1]
    processing = LogprobProcessing(**controls, eos_ids=(tiny_tokenizer.eos_token_id,))
    gen, _ = sample_recording_logprobs(peaked, tiny_tokenizer,
                                       SamplingParams(n=4, max_tokens=8, temperature=0.9, **controls), monkeypatch)

    def stats(old_processing):
        batch = RolloutBatch(generation=gen, rewards=torch.zeros(8), reward_parts=torch.zeros(8, 1), reward_names=["r"],
                             advantages=torch.randn(8, generator=torch.Generator().manual_seed(0)),
                             old_logprobs=generation_logprobs(peaked, gen, 0.9, 4, old_processing), ref_logprobs=None,
                             prompts=[""] * 2)
        return train_on_batch(RecordingLearner(peaked), batch, settings_with(processing=processing), DistInfo()).totals

    matched = stats(processing)
    assert abs(matched["ratio_mean"] - 1.0) < 1e-5 and matched["clip_fraction"] == 0.0
    assert abs(stats(None)["ratio_mean"] - 1.0) > 0.01
