"""Rollouts and log-probs: masks up to the first EOS, left padding, and log-probs equal to what was sampled."""

from __future__ import annotations

import pytest
import torch
from step_helpers import chat

from grpo.data.prompt_sampler import PromptSampler
from grpo.models.tiny import build_qwen2
from grpo.rollout import HFEngine, SamplingParams, completion_mask_from_ids
from grpo.step.logprobs import completion_logprobs


def test_completion_mask_up_to_and_including_first_eos():
    eos = 9
    ids = torch.tensor([
        [5, 6, 9, 9, 9],  # EOS at 2; the rest is padding even though pad == eos
        [5, 9, 7, 9, 0],  # the first EOS ends it; a later EOS does not count
        [1, 2, 3, 4, 5],  # no EOS: truncated, all tokens count
        [9, 0, 0, 0, 0],  # an immediately stopped completion keeps its EOS token
    ])
    mask, truncated = completion_mask_from_ids(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]
    mask2, _ = completion_mask_from_ids(torch.tensor([[3, 4, 8]]), [9, 8])  # several EOS ids
    assert mask2.tolist() == [[1, 1, 1]]


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, seed=1).eval()


def test_engine_groups_rows_and_masks(tiny_model, tiny_tokenizer):
    prompts = [chat(tiny_tokenizer, "What is 2 + 2?"), chat(tiny_tokenizer, "Tom has 12 apples and buys 7 more.")]
    gen = HFEngine(tiny_model, tiny_tokenizer).generate(prompts, SamplingParams(n=3, max_tokens=12), seed=0)
    N = 6
    assert gen.prompt_ids.shape[0] == N and gen.completion_ids.shape[0] == N
    # Rows 0-2 share prompt 0, rows 3-5 prompt 1; the shorter prompt is left-padded.
    assert torch.equal(gen.prompt_ids[0], gen.prompt_ids[2]) and torch.equal(gen.prompt_ids[3], gen.prompt_ids[5])
    assert gen.prompt_mask[0, 0] == 0 and gen.prompt_mask[3].all()
    assert len(gen.completions) == N and gen.completion_ids.shape[1] <= 12
    assert (gen.completion_mask.sum(1) >= 1).all()
    # Same seed, same completions (the resume guarantee rests on this).
    again = HFEngine(tiny_model, tiny_tokenizer).generate(prompts, SamplingParams(n=3, max_tokens=12), seed=0)
    assert torch.equal(gen.completion_ids, again.completion_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_sampling_distribution(tiny_model, tiny_tokenizer, temperature):
    # Prompts of different lengths, so left padding is exercised: the training-side log-probs
    # (one forward pass over prompt + completion) must match generate()'s own per-step logits.
    from transformers import GenerationConfig

    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "A train travels 60 miles per hour for 3 hours.")]
    encoded = tiny_tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = tiny_model.generate(
        **encoded, generation_config=GenerationConfig(
            do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=10,
            return_dict_in_generate=True, output_logits=True, eos_token_id=-1,
            pad_token_id=tiny_tokenizer.pad_token_id))
    completion = out.sequences[:, encoded["input_ids"].shape[1]:]  # [2, 10]
    step_logits = torch.stack(out.logits, dim=1)  # [2, 10, V] raw logits of each sampled step
    expected = torch.log_softmax(step_logits.float() / temperature, -1).gather(-1, completion[..., None])[..., 0]
    got = completion_logprobs(tiny_model, encoded["input_ids"], encoded["attention_mask"], completion,
                              torch.ones_like(completion), temperature)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_prompt_sampler_partitions_prompts_across_ranks_and_epochs():
    sampler = PromptSampler(num_examples=10, prompts_per_step=4, seed=3)
    seen = [i for step in range(1, 6) for i in sampler.step_indices(step)]  # 20 = two full epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    for step in (1, 2, 3):
        r0, r1 = sampler.rank_indices(step, 0, 2), sampler.rank_indices(step, 1, 2)
        assert len(r0) == len(r1) == 2 and not set(r0) & set(r1)
        assert r0 + r1 == sampler.step_indices(step)
    with pytest.raises(ValueError, match="not divisible"):
        sampler.rank_indices(1, 0, 3)
    assert PromptSampler(10, 4, seed=3).step_indices(2) == sampler.step_indices(2)  # stateless


def test_tiny_tokenizer_keeps_answer_tags_when_decoding(tiny_tokenizer):
    # Completions are decoded with skip_special_tokens=True before rewards read them: the tags must
    # survive (they are single added tokens, not special ones), while <|im_end|> is dropped.
    text = "<think>\n1 + 2 = 3\n</think>\n<answer>\n3\n</answer>"
    ids = tiny_tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tiny_tokenizer.convert_ids_to_tokens(ids)[0] == "<think>"
