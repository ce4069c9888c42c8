"""The engines' ``generate_ids`` (issue 27): the same rows as ``generate`` for the same seed, and on ``hf`` /
``hf-static`` turns that continue from the rows' cached keys/values: the same tokens as prefilling the whole
conversation again, far fewer tokens fed, and a cache that cannot outlive its rollout."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from grpo.compat import returned_cache
from grpo.rollout import HFEngine, LeanEngine, SamplingParams, StaticEngine
from grpo.rollout.engine import PrefixCachingEngine, TokenIdsEngine
from grpo.rollout.prefix_cache import PrefixCache

TINY_MATH = Path(__file__).resolve().parents[2] / "assets" / "tiny-math"
QUESTIONS = ["What is 3 + 4?", "Tom has 12 apples and buys 7 more. How many apples does he have?", "5 * 6?"]
# What a tool turn inserts (a user turn stands in for the template's tool message: same kind of tokens)
TOOL = "<|im_start|>user\nThe calculator returned 42, then more text to make the result long.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_math():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MATH)
    model = AutoModelForCausalLM.from_pretrained(TINY_MATH).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    return model, tokenizer, prompts


ENGINES = {"hf-generate": HFEngine, "hf": LeanEngine, "hf-static": StaticEngine}


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("greedy", [True, False])
def test_generate_is_tokenising_then_generate_ids(tiny_math, name, greedy):
    model, tokenizer, prompts = tiny_math
    engine = ENGINES[name](model, tokenizer)
    assert isinstance(engine, TokenIdsEngine)
    params = SamplingParams(n=1 if greedy else 3, max_tokens=24, greedy=greedy)  # generate: greedy is n=1 only
    by_text = engine.generate(prompts, params, seed=5)
    by_ids = engine.generate_ids([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts], params, seed=5)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(by_text, field), getattr(by_ids, field)), field
    assert by_text.completions == by_ids.completions


class PrefillCounter:
    """Tokens the model's prefills are fed (padding included): the calls with ``logits_to_keep`` (decode
    steps feed one token per row without it)."""

    def __init__(self, model: torch.nn.Module):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        if "logits_to_keep" in kwargs:
            self.tokens += kwargs["input_ids"].numel()


def three_turns(engine, tokenizer, prompts, greedy: bool, cached: bool, seed: int = 1):
    """A multi-turn rollout as the driver runs it: G=2 rows per prompt, then two turns of n=1 per row, each
    continuing from prompt + its sampled turn + a tool result. Returns every call's completion ids and the
    cache (None without)."""
    tool = tokenizer(TOOL, add_special_tokens=False)["input_ids"]
    with (engine.cached_turns() if cached else nullcontext(engine)) as turns:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out = turns.generate_ids(ids, SamplingParams(n=2, max_tokens=16, greedy=greedy), seed=seed)
        rows = [ids[i // 2] + out.completion_ids[i][out.completion_mask[i].bool()].tolist() + tool
                for i in range(len(ids) * 2)]
        calls = [out.completion_ids]
        for turn in range(2):
            out = turns.generate_ids(rows, SamplingParams(n=1, max_tokens=12, greedy=greedy), seed=seed + 1 + turn)
            calls.append(out.completion_ids)
            rows = [row + out.completion_ids[i][out.completion_mask[i].bool()].tolist() + tool
                    for i, row in enumerate(rows)]
        cache = getattr(turns, "cache", None)
    return calls, cache


def sampling_model(engine):
    return engine.copy.model if isinstance(engine, StaticEngine) else engine.model


@pytest.mark.parametrize("name", ["hf", "hf-static"])
@pytest.mark.parametrize("greedy", [True, False])
def test_cached_turns_give_the_same_tokens_and_feed_fewer(tiny_math, name, greedy):
    model, tokenizer, prompts = tiny_math
    engine = ENGINES[name](model, tokenizer)
    assert isinstance(engine, PrefixCachingEngine)
    fed = {}
    results = {}
    for cached in (False, True):
        counter = PrefillCounter(sampling_model(engine))
        results[cached], cache = three_turns(engine, tokenizer, prompts, greedy, cached)
        counter.handle.remove()
        fed[cached] = counter.tokens
    # Same seed, same draws: token for token the same rollout (the rows end at different tokens and turns)
    for plain, reused in zip(results[False], results[True]):
        assert torch.equal(plain, reused)
    # Turn 1 is fed the same; turns 2 and 3 only the EOS and the tool result per row, not the conversation
    assert fed[True] < fed[False] / 2, fed
    assert cache.closed and cache.entries == []  # freed at the end of the block


def test_lean_rows_of_a_batch_split_over_calls_and_a_lora_policy_reuse_exactly(tiny_math):
    # generation_batch_size 2: the rows of one turn are sampled in several chunks (rows leave their chunk's
    # cache as they finish); a LoRA policy samples with its adapter folded in, each call anew.
    peft = pytest.importorskip("peft")
    import copy

    model, tokenizer, prompts = tiny_math
    policy = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for pname, p in policy.named_parameters():
            if "lora_B" in pname:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    engine = LeanEngine(policy, tokenizer, batch_size=2)
    plain, _ = three_turns(engine, tokenizer, prompts[:2], greedy=True, cached=False)
    reused, _ = three_turns(engine, tokenizer, prompts[:2], greedy=True, cached=True)
    for a, b in zip(plain, reused):
        assert torch.equal(a, b)


def test_cached_keys_are_a_full_prefill_s_up_to_float_order(tiny_math):
    # Each stored row's keys/values against one forward over its ids alone: the cache holds exactly the
    # positions and tokens it says (float32: only the summation order of the attention differs).
    model, tokenizer, prompts = tiny_math
    engine = LeanEngine(model, tokenizer)
    with engine.cached_turns() as turns:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        turns.generate_ids(ids, SamplingParams(n=2, max_tokens=20), seed=3)
        entries = list(turns.cache.entries)
        assert len(entries) == 6
        for entry in entries:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([entry.ids]), use_cache=True)
            for layer, (keys, values) in enumerate(zip(entry.keys, entry.values)):
                expected = returned_cache(out).layers[layer]
                torch.testing.assert_close(keys, expected.keys[0], rtol=0, atol=2e-5)
                torch.testing.assert_close(values, expected.values[0], rtol=0, atol=2e-5)


def test_the_cache_is_freed_when_its_block_ends_even_on_error(tiny_math):
    model, tokenizer, prompts = tiny_math
    engine = LeanEngine(model, tokenizer)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    with pytest.raises(KeyError):
        with engine.cached_turns() as turns:
            turns.generate_ids(ids, SamplingParams(n=2, max_tokens=8), seed=0)
            assert len(turns.cache.entries) == 6
            raise KeyError("a tool blew up")
    assert turns.cache.closed and turns.cache.entries == []
    # Reusing it after the rollout (the weights have changed since) is refused, not silently stale
    with pytest.raises(RuntimeError, match="cleared when its rollout ended"):
        turns.generate_ids(ids, SamplingParams(n=1, max_tokens=8), seed=0)
    # and every rollout gets its own cache
    with engine.cached_turns() as again:
        assert again.cache is not turns.cache and again.cache.entries == []


def test_a_continued_row_replaces_its_entry():
    # take(): the longest stored proper prefix; the matched entries leave (the new row's entry holds them);
    # of two equal entries (greedy samples of one prompt) each continuation takes its own.
    from grpo.rollout.prefix_cache import CachedPrefix

    cache = PrefixCache()
    short, long_, twin = (CachedPrefix(ids, [], []) for ids in ([1, 2], [1, 2, 3], [1, 2, 3]))
    cache.entries = [short, long_, twin]
    assert cache.take([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3], [9]]) == [long_, twin, short, None]
    assert cache.entries == []
