"""The engines' prefill: a shared prefix run once and the rests in passes of similar length must give what
the padded pass gives (logits, and the generation that continues from the cache)."""

from __future__ import annotations

import pytest
import torch

from grpo.models.tiny import build_qwen2
from grpo.rollout import HFEngine, SamplingParams
from grpo.rollout.lean import LeanEngine
from grpo.rollout.prefill import MIN_SHARED_PREFIX, common_prefix_length, prefill, rest_passes
from grpo.rollout.static import StaticEngine


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, seed=3).eval()


def test_common_prefix_leaves_every_prompt_a_token_of_its_own():
    assert common_prefix_length([[1, 2, 3]]) == 0  # one prompt: nothing to share
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4, 5]]) == 2  # the shorter keeps its last token
    assert common_prefix_length([[7, 2], [1, 2]]) == 0


def test_rest_passes_group_similar_lengths_and_keep_every_row_once():
    assert rest_passes([10, 11, 9, 10]) == [[2, 0, 3, 1]]  # alike: one pass, sorted by length
    passes = rest_passes([3, 40, 4, 38, 3])
    assert passes == [[0, 4, 2], [3, 1]]
    lengths = [5, 80, 17, 3, 120, 33, 34, 9]
    passes = rest_passes(lengths)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    for p in passes:  # padding within the slack (a lone row has none)
        assert len(p) * max(lengths[i] for i in p) <= 1.25 * sum(lengths[i] for i in p)


def prompts_with_a_shared_system_prompt(tokenizer) -> list[str]:
    system = "You are a careful assistant. Think step by step, then give the answer in tags. " * 2
    questions = ["Hi", "Tom has 12 apples and buys 7 more apples. How many now?", "2+2?",
                 "A train leaves at 3 pm and travels 60 miles at 30 miles per hour; when does it arrive there?"]
    return [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                          tokenize=False, add_generation_prompt=True) for q in questions]


def test_shared_and_grouped_prefill_gives_the_padded_pass_logits(model, tiny_tokenizer):
    prompts = prompts_with_a_shared_system_prompt(tiny_tokenizer)
    encoded = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    shared = common_prefix_length(encoded)
    assert shared >= MIN_SHARED_PREFIX and len(rest_passes([len(e) - shared for e in encoded])) > 1
    calls = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        first = prefill(model, encoded, tiny_tokenizer.pad_token_id, torch.device("cpu"), None)
    hook.remove()
    assert calls[0] == (1, shared) and all(rows < len(encoded) for rows, _ in calls[1:])  # prefix once, then rests
    with torch.no_grad():
        for row, ids in enumerate(encoded):  # each prompt alone, unpadded
            alone = model(input_ids=torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(first.logits[row], alone, atol=1e-5, rtol=1e-4)
            assert int(first.key_mask[row].sum()) == len(ids) and int(first.last_position[row]) == len(ids) - 1


@pytest.mark.parametrize("engine", [LeanEngine, StaticEngine])
def test_generation_after_the_shared_prefill_equals_generate(model, tiny_tokenizer, engine):
    prompts = prompts_with_a_shared_system_prompt(tiny_tokenizer)
    params = SamplingParams(n=1, max_tokens=16, greedy=True)
    ours = engine(model, tiny_tokenizer).generate(prompts, params)
    ref = HFEngine(model, tiny_tokenizer).generate(prompts, params)
    assert torch.equal(ours.completion_ids, ref.completion_ids[:, : ours.completion_ids.shape[1]])
    assert torch.equal(ours.completion_mask, ref.completion_mask[:, : ours.completion_mask.shape[1]])
    # sampling: G rows per prompt continue from one prefill, the same seed draws the same tokens
    sampled = SamplingParams(n=3, max_tokens=12, temperature=1.0)
    a = engine(model, tiny_tokenizer).generate(prompts, sampled, seed=5)
    b = engine(model, tiny_tokenizer).generate(prompts, sampled, seed=5)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completion_ids.shape[0] == 12


def test_a_sliding_window_model_takes_the_padded_pass(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, seed=3)
    model.config.use_sliding_window, model.config.sliding_window = True, 8
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model = type(model)(model.config).eval()
    prompts = prompts_with_a_shared_system_prompt(tiny_tokenizer)
    params = SamplingParams(n=1, max_tokens=12, greedy=True)
    lean = LeanEngine(model, tiny_tokenizer).generate(prompts, params)
    ref = HFEngine(model, tiny_tokenizer).generate(prompts, params)
    assert torch.equal(lean.completion_ids, ref.completion_ids[:, : lean.completion_ids.shape[1]])
