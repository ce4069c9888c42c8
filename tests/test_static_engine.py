"""The hf-static engine (static KV cache, graph-replayed decode step, sampling copy) samples what the
hf engine samples: greedy equals generate(), the draws follow the model's distribution, a seed fixes
them, LoRA is merged into the copy, the copy follows the policy's updates, and a decode step never
reads a value back to the host (what a CUDA graph needs; CUDA graphs themselves need a GPU: ``-m gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from step_helpers import CountSyncs, chat

from grpo.models.tiny import build_qwen2
from grpo.rollout import HFEngine, SamplingParams
from grpo.rollout.lean import LeanEngine
from grpo.rollout.static import StaticEngine


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, seed=3).eval()


def prompts_of(tokenizer):
    return [chat(tokenizer, "Hi"), chat(tokenizer, "Tom has 12 apples and buys 7 more apples.")]


def assert_same_prefix(ours, ref):
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids, ref.completion_ids[:, :width])
    assert torch.equal(ours.completion_mask, ref.completion_mask[:, :width])


def test_greedy_equals_generate(model, tiny_tokenizer):
    # mixed prompt lengths (left padding), rows that end early and rows that run to max_tokens
    params = SamplingParams(n=1, max_tokens=20, greedy=True)
    ours = StaticEngine(model, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params)
    assert_same_prefix(ours, HFEngine(model, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params))


def test_llama_greedy_equals_generate(tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)).eval()
    params = SamplingParams(n=1, max_tokens=16, greedy=True)
    ours = StaticEngine(llama, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params)
    assert_same_prefix(ours, HFEngine(llama, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), params))


def test_samples_follow_the_model_distribution(model, tiny_tokenizer):
    # 4000 samples of one prompt at T=0.7, top_k=5: first-token frequencies against the distribution
    # transformers' warpers define; sampling noise in total variation over 5 tokens is ~0.01, a missing
    # temperature or filter moves it by > 0.05. The second token is drawn inside the decode step: its
    # conditional distribution after the most frequent first token is checked the same way.
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    prompt = chat(tiny_tokenizer, "What is 2 + 2?")
    T, n = 0.7, 4000
    gen = StaticEngine(model, tiny_tokenizer).generate(
        [prompt], SamplingParams(n=n, max_tokens=2, temperature=T, top_k=5), seed=1)
    ids = tiny_tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]

    def expected(prefix):
        with torch.no_grad():
            logits = model(prefix).logits[:, -1]
        return torch.softmax(TopKLogitsWarper(5)(None, TemperatureLogitsWarper(T)(None, logits)), -1)[0]

    first = gen.completion_ids[:, 0]
    probs = expected(ids)
    tv = 0.5 * (torch.bincount(first, minlength=probs.numel()).float() / n - probs).abs().sum().item()
    assert tv < 0.03, tv
    top = torch.bincount(first).argmax()
    if top.item() not in (tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id):
        rows = first == top
        second = gen.completion_ids[rows, 1]
        probs2 = expected(torch.cat([ids, top.view(1, 1)], 1))
        tv2 = 0.5 * (torch.bincount(second, minlength=probs2.numel()).float() / rows.sum() - probs2).abs().sum()
        assert tv2 < 0.05, (tv2, rows.sum())


def test_a_seed_fixes_the_draws(model, tiny_tokenizer):
    engine = StaticEngine(model, tiny_tokenizer)
    params = SamplingParams(n=4, max_tokens=12, top_p=0.9)
    a, b, c = (engine.generate(prompts_of(tiny_tokenizer), params, seed=s) for s in (7, 7, 8))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])  # the G samples of a prompt differ


def test_generation_batches_give_the_same_greedy_rows(model, tiny_tokenizer):
    params = SamplingParams(n=2, max_tokens=14, greedy=True)
    prompts = prompts_of(tiny_tokenizer) * 2
    whole = StaticEngine(model, tiny_tokenizer).generate(prompts, params)
    batched = StaticEngine(model, tiny_tokenizer, batch_size=2).generate(prompts, params)
    assert torch.equal(whole.completion_ids, batched.completion_ids)


def test_lora_is_merged_into_the_sampling_copy_and_updates_reach_it(model, tiny_tokenizer):
    # greedy equals generate() on the peft model itself; the base weights are untouched; after the
    # adapter changes (an optimizer step) the next call samples from the new weights, never stale ones
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))

    def set_adapter(seed):
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5, generator=torch.Generator().manual_seed(seed))

    set_adapter(0)
    base_before = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items() if "lora" not in k}
    params = SamplingParams(n=1, max_tokens=16, greedy=True)
    engine = StaticEngine(peft_model, tiny_tokenizer)
    prompts = prompts_of(tiny_tokenizer)
    first = engine.generate(prompts, params)
    assert_same_prefix(first, HFEngine(peft_model, tiny_tokenizer).generate(prompts, params))
    set_adapter(1)
    second = engine.generate(prompts, params)
    assert_same_prefix(second, HFEngine(peft_model, tiny_tokenizer).generate(prompts, params))
    assert not torch.equal(first.completion_ids, second.completion_ids[:, : first.completion_ids.shape[1]])
    after = peft_model.get_base_model().state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base_before.items())
    assert not any("lora" in name for name, _ in engine.copy.model.named_parameters())


def test_full_weight_updates_reach_the_copy(tiny_tokenizer):
    policy = build_qwen2(tiny_tokenizer, seed=3)
    engine = StaticEngine(policy, tiny_tokenizer)
    params = SamplingParams(n=1, max_tokens=12, greedy=True)
    prompts = prompts_of(tiny_tokenizer)
    engine.generate(prompts, params)
    policy.load_state_dict(build_qwen2(tiny_tokenizer, seed=4).state_dict())  # "an update"
    assert_same_prefix(engine.generate(prompts, params), LeanEngine(policy, tiny_tokenizer).generate(prompts, params))


def test_bf16_sampling_copy(model, tiny_tokenizer):
    # the GPU default: the copy holds each weight once in bf16 (half the fp32 policy's bytes)
    engine = StaticEngine(model, tiny_tokenizer, dtype=torch.bfloat16)
    assert {p.dtype for p in engine.copy.model.parameters()} == {torch.bfloat16}
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert engine.copy.num_bytes() * 2 == fp32_bytes
    gen = engine.generate(prompts_of(tiny_tokenizer), SamplingParams(n=3, max_tokens=10), seed=0)
    assert gen.completion_ids.shape[0] == 6 and gen.completion_mask[:, 0].all()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy is untouched


def test_no_host_sync_per_token(model, tiny_tokenizer):
    # The decode step must be capturable: no value read back to the host inside it. The count of
    # would-be syncs over a whole call cannot grow with the number of tokens (the only per-call ones
    # are the prefill's and the EOS checks, every eos_check_every tokens; set beyond the run here).
    def syncs(max_tokens):
        engine = StaticEngine(model, tiny_tokenizer, eos_check_every=1000)
        counter = CountSyncs()
        with counter:
            engine.generate(prompts_of(tiny_tokenizer), SamplingParams(n=2, max_tokens=max_tokens), seed=0)
        return sum(counter.by_file.values())

    assert syncs(6) == syncs(30)


def test_unsupported_models_and_modes_are_refused(model, tiny_tokenizer):
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        StaticEngine(model, tiny_tokenizer, decode_graph="cuda-graph")
    with pytest.raises(ValueError, match="known"):
        StaticEngine(model, tiny_tokenizer, decode_graph="fast")
    sliding = build_qwen2(tiny_tokenizer, seed=3)
    sliding.config.use_sliding_window, sliding.config.sliding_window = True, 8
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    sliding = type(sliding)(sliding.config).eval()
    with pytest.raises(ValueError, match="full-attention models only"):
        StaticEngine(sliding, tiny_tokenizer).generate(prompts_of(tiny_tokenizer), SamplingParams(max_tokens=4))


@pytest.mark.slow
def test_compiled_step_has_no_graph_break_and_equals_eager(model, tiny_tokenizer):
    # torch.compile(fullgraph=True) fails on any graph break (a host read, an unsupported op): the same
    # property CUDA graph capture needs, checked on a CPU. ~30 s of compilation on 2 cores.
    params = SamplingParams(n=2, max_tokens=10, temperature=0.8, top_k=20)
    eager = StaticEngine(model, tiny_tokenizer, decode_graph="eager").generate(prompts_of(tiny_tokenizer), params, seed=5)
    compiled = StaticEngine(model, tiny_tokenizer, decode_graph="compile").generate(
        prompts_of(tiny_tokenizer), params, seed=5)
    assert torch.equal(eager.completion_ids, compiled.completion_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_equals_eager_on_gpu(model, tiny_tokenizer):
    gpu_model = copy.deepcopy(model).cuda()
    params = SamplingParams(n=4, max_tokens=40, greedy=True)
    eager = StaticEngine(gpu_model, tiny_tokenizer, dtype=torch.float32, decode_graph="eager")
    graph = StaticEngine(gpu_model, tiny_tokenizer, dtype=torch.float32)
    assert graph.decode_graph == "cuda-graph"
    a = eager.generate(prompts_of(tiny_tokenizer), params)
    b = graph.generate(prompts_of(tiny_tokenizer), params)
    assert graph.graph_failure is None
    assert torch.equal(a.completion_ids, b.completion_ids)
    sampled = SamplingParams(n=4, max_tokens=40, temperature=1.0, top_p=0.95)
    assert torch.equal(eager.generate(prompts_of(tiny_tokenizer), sampled, seed=1).completion_ids,
                       graph.generate(prompts_of(tiny_tokenizer), sampled, seed=1).completion_ids)
