"""grpo.compat: each version-dependent branch, whichever transformers release is installed (the release is
passed in); the old generate branch's processor against transformers' own and end to end through generate;
the KV cache name through a real forward on the installed release (CI runs both ends of the range)."""

from __future__ import annotations

import types

import pytest
import torch
from step_helpers import chat
from transformers import GenerationConfig
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from grpo.compat import (PaddingFreeRepetitionPenalty, cache_argument, generate_repetition_penalty, generate_skips_left_padding,
                         model_cache_name, returned_cache)
from grpo.models.tiny import build_qwen2
from grpo.models.wrappers import eos_token_ids
from grpo.rollout import SamplingParams
from grpo.rollout.hf import HFEngine, left_pad
from grpo.rollout.lean import LeanEngine


@pytest.mark.parametrize(("release", "skips"), [("5.17.0", False), ("5.22.2", False), ("5.23.0", True),
                                                ("5.23.0.dev0", True), ("5.24.0", True), ("6.0.0", True)])
def test_which_releases_leave_left_padding_out_of_generates_penalty(release, skips):
    assert generate_skips_left_padding(release) is skips


def test_the_installed_release_is_asked_by_default():
    import transformers

    assert generate_skips_left_padding() is generate_skips_left_padding(transformers.__version__)


def test_from_5_23_generate_takes_the_config_as_it_is():
    config = GenerationConfig(do_sample=True, repetition_penalty=1.3, num_return_sequences=2)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    same, processors = generate_repetition_penalty(config, mask, "5.23.0")
    assert same is config and len(processors) == 0
    off = GenerationConfig(repetition_penalty=1.0)  # no penalty: nothing to do on any release
    assert generate_repetition_penalty(off, mask, "5.17.0")[0] is off


def test_before_5_23_a_processor_applies_the_penalty_without_the_padding():
    config = GenerationConfig(do_sample=True, repetition_penalty=1.3, num_return_sequences=2)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    without, processors = generate_repetition_penalty(config, mask, "5.17.0")
    assert without.repetition_penalty == 1.0 and config.repetition_penalty == 1.3  # a copy; the caller's stays
    assert without.num_return_sequences == 2 and len(processors) == 1
    (processor,) = processors
    assert isinstance(processor, PaddingFreeRepetitionPenalty)
    assert processor.first_real.tolist() == [2, 2, 0, 0]  # generate repeats each prompt's row n times
    # input rows as generate sees them: the expanded prompts (pad id 0) and two generated tokens
    ids = torch.tensor([[0, 0, 5, 6, 7, 5]] * 2 + [[1, 2, 3, 4, 0, 9]] * 2)
    scores = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)) * 3
    got = processor(ids, scores.clone())
    want = torch.cat([RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=first)(ids[i:i + 1], scores[i:i + 1].clone())
                      for i, first in enumerate([2, 2, 0, 0])])
    assert torch.equal(got, want)
    counted = RepetitionPenaltyLogitsProcessor(1.3)(ids, scores.clone())  # what 5.17's generate did
    assert not torch.equal(counted[0], got[0]) and torch.equal(counted[2], got[2])  # only padded rows differ


def test_the_old_branch_through_generate_equals_the_lean_engine(tiny_tokenizer):
    """Greedy rows of left-padded prompts whose model makes the pad token likely: generate with the old
    branch's config and processor (on the installed transformers) gives the lean engine's rows, which never
    count padding; counting it would penalise the pad token in the padded row and change its tokens."""
    pad = tiny_tokenizer.pad_token_id
    model = build_qwen2(tiny_tokenizer, seed=3, tie_word_embeddings=False).eval()
    prompts = [chat(tiny_tokenizer, "Hi"), chat(tiny_tokenizer, "Tom has 12 apples and buys 7 more apples.")]
    encoded = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert all(pad not in row for row in encoded)
    with torch.no_grad():
        first = model(torch.tensor([encoded[0]])).logits[0, -1].argmax()
        model.lm_head.weight[pad] = model.lm_head.weight[first] * 1.02  # the pad token just above the greedy one
    params = SamplingParams(n=1, max_tokens=6, greedy=True, repetition_penalty=1.5)
    lean = LeanEngine(model, tiny_tokenizer).generate(prompts, params)

    ids, mask = left_pad(encoded, pad)
    config = HFEngine._generation_config(params, pad, eos_token_ids(model, tiny_tokenizer))
    rows = {}
    for release in ("5.17.0", None):  # None: what HFEngine does on the installed release
        call_config, processors = generate_repetition_penalty(config, mask, release)
        with torch.no_grad():
            rows[release] = model.generate(input_ids=ids, attention_mask=mask, generation_config=call_config,
                                           logits_processor=processors)[:, ids.shape[1]:]
    for out in rows.values():
        width = lean.completion_ids.shape[1]
        assert torch.equal(out[:, :width].masked_fill(lean.completion_mask == 0, pad), lean.completion_ids)
    assert lean.completion_ids[0, 0] == pad  # the padded row ("Hi" is the shorter prompt) starts with the pad token


@pytest.mark.parametrize(("release", "name"), [("5.17.0", "past_key_values"), ("5.23.0", "past_key_values"),
                                               ("5.24.0", "cache"), ("5.24.0.dev0", "cache"), ("5.39.1", "cache")])
def test_which_releases_name_the_kv_cache_cache(release, name):
    assert model_cache_name(release) == name
    assert cache_argument("kv", release) == {name: "kv"}
    assert returned_cache(types.SimpleNamespace(**{name: "kv"}), release) == "kv"


def test_the_installed_release_continues_from_the_cache_it_returned(tiny_tokenizer):
    """A prompt pass, then its continuation fed with the returned cache under the installed release's name,
    gives the logits of one pass over both: a cache passed under a name the model ignores (its forward
    takes **kwargs) would leave the continuation without its context."""
    model = build_qwen2(tiny_tokenizer, seed=0).eval()
    ids = torch.tensor([tiny_tokenizer("Tom has 12 apples and buys 7 more.", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits[:, 5:]
        first = model(input_ids=ids[:, :5], use_cache=True)
        cache = returned_cache(first)
        assert cache is not None
        rest = model(input_ids=ids[:, 5:], position_ids=torch.arange(5, ids.shape[1])[None], use_cache=True,
                     **cache_argument(cache)).logits
    assert torch.allclose(rest, whole, atol=1e-5)



SAVE_WITHOUT_DEEPSPEED = """
import json, sys
from grpo.compat import save_pretrained
from grpo.models.tiny import build_qwen2, build_tokenizer
save_pretrained(build_qwen2(build_tokenizer(), seed=0), sys.argv[1])
print(json.dumps("deepspeed" in sys.modules))
"""


def test_save_pretrained_writes_what_transformers_writes_without_importing_deepspeed(tmp_path, tiny_tokenizer):
    import subprocess
    import sys

    pytest.importorskip("deepspeed")  # the import it avoids; without deepspeed there is nothing to avoid
    out = subprocess.run([sys.executable, "-c", SAVE_WITHOUT_DEEPSPEED, str(tmp_path / "ours")], check=True,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.splitlines()[-1] == "false"
    build_qwen2(tiny_tokenizer, seed=0).save_pretrained(tmp_path / "theirs")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (tmp_path / "theirs").iterdir())


def test_save_pretrained_still_unwraps_what_is_not_a_pretrained_model(tiny_tokenizer):
    import transformers.modeling_utils

    from grpo.compat import _pretrained_models_unwrap_as_themselves

    model = build_qwen2(tiny_tokenizer, seed=0)
    wrapped = torch.nn.DataParallel(model)  # what transformers' own unwrap is for
    original = transformers.modeling_utils.unwrap_model
    with _pretrained_models_unwrap_as_themselves():
        assert transformers.modeling_utils.unwrap_model is not original
        assert transformers.modeling_utils.unwrap_model(model) is model
        assert transformers.modeling_utils.unwrap_model(wrapped) is model
    assert transformers.modeling_utils.unwrap_model is original  # put back


def test_a_release_without_unwrap_model_gets_nothing_put_in(monkeypatch):
    import transformers.modeling_utils

    from grpo.compat import _pretrained_models_unwrap_as_themselves

    monkeypatch.delattr(transformers.modeling_utils, "unwrap_model")
    with _pretrained_models_unwrap_as_themselves():
        assert not hasattr(transformers.modeling_utils, "unwrap_model")
    assert not hasattr(transformers.modeling_utils, "unwrap_model")
