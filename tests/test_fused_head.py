"""Log-probs from the final hidden states with the LM head applied a chunk at a time (grpo.algorithm.head,
``train.fused_lm_head``) equal the logits path: values, entropy and gradients, for every pass shape (plain
and shared prompt), tied and untied heads, LoRA (on the head too), temperature, the sampling controls,
gradient checkpointing; and no pass makes a [b, L, V] logits tensor."""

from __future__ import annotations

import pytest
import torch

from grpo.algorithm import LogprobProcessing, processed_token_entropy, processed_token_logprobs, token_entropy
from grpo.algorithm import token_logprobs
from grpo.algorithm.head import head_logprobs
from grpo.models.tiny import build_qwen2
from grpo.config.device_defaults import pass_defaults
from grpo.step.logprob_pass import uses_fused_head
from grpo.step.logprobs import completion_logprobs

from test_logprobs import grouped_rows

PROCESSING = LogprobProcessing(repetition_penalty=1.3, min_new_tokens=3, min_p=0.05, eos_ids=(1, 2))


def reference_and_fused(B=3, L=7, H=8, V=23, temperature=0.7, processing=None, chunk=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
    hidden = torch.randn(B, L, H, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(3, V, (B, L), generator=gen)  # never an EOS id: a sampled token is never forbidden
    real = (torch.arange(L)[None] < torch.tensor([L, 4, 2])[:, None]).long()
    seen = torch.rand(B, V, generator=gen) < 0.2
    return head, hidden, targets, real, seen


@pytest.mark.parametrize("processing", [None, PROCESSING])
def test_head_logprobs_equal_the_logits_path_values_entropy_and_gradients(processing):
    head, hidden, targets, real, seen = reference_and_fused()
    logits = head(hidden)  # [B, L, V]
    if processing is None:  # token_logprobs: position t predicts token t + 1 of its input
        padded = torch.cat([targets[:, :1], targets], 1)
        expected = token_logprobs(torch.cat([logits, logits[:, -1:]], 1), padded, 0.7)
        expected_entropy = token_entropy(torch.cat([logits, logits[:, -1:]], 1), 0.7)
    else:
        expected = processed_token_logprobs(logits, targets, real, seen, 0.7, processing)
        expected_entropy = processed_token_entropy(logits, targets, real, seen, 0.7, processing)
    (expected * real).sum().backward()
    want = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    got, entropy = head_logprobs(hidden, head, targets, 0.7, vocab_size=23, with_entropy=True, processing=processing,
                                 real=real, prompt_seen=seen, chunk_columns=2)
    (got * real).sum().backward()
    close = dict(atol=1e-6, rtol=1e-5)  # token_logprobs' CPU row loop computes in float32
    torch.testing.assert_close(got, expected.to(got.dtype), **close)
    torch.testing.assert_close(entropy, expected_entropy.to(entropy.dtype), **close)
    torch.testing.assert_close(hidden.grad, want[0], **close)
    torch.testing.assert_close(head.weight.grad, want[1], **close)


def test_head_logprobs_keep_no_logits_for_backward():
    # under autograd each chunk is checkpointed: what stays saved is the hidden chunks, never [B, c, V] logits
    head, hidden, targets, _, _ = reference_and_fused(B=2, L=12, H=4, V=50, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = head_logprobs(hidden, head, targets, 1.0, vocab_size=50, chunk_columns=3)
    assert saved and all(50 not in shape for shape in saved), saved
    out.sum().backward()
    assert hidden.grad is not None and head.weight.grad is not None


def test_bad_input_is_a_clear_error():
    head, hidden, targets, _, _ = reference_and_fused()
    with pytest.raises(ValueError, match=r"hidden \[B, L, H\] and targets \[B, L\] disagree"):
        head_logprobs(hidden, head, targets[:, 1:], 1.0, vocab_size=23)
    with pytest.raises(ValueError, match="needs real"):
        head_logprobs(hidden, head, targets, 1.0, vocab_size=23, processing=PROCESSING)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        head_logprobs(hidden, head, targets, 0.0, vocab_size=23)


def llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def lora(model, targets):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


MODELS = {
    "qwen2-tied": lambda tok: build_qwen2(tok, hidden_size=32, num_layers=2, seed=0),
    "llama-untied": llama,
    "lora-all-linear": lambda tok: lora(build_qwen2(tok, hidden_size=32, num_layers=2, seed=1), "all-linear"),
    "lora-on-lm-head": lambda tok: lora(llama(tok), ["q_proj", "v_proj", "lm_head"]),
}


def pass_and_grads(model, rows, **options):
    """(log-probs, entropy, gradients) of one ``completion_logprobs`` pass with ``options``, under grad."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, *rows, temperature=0.7, micro_batch_size=4, with_entropy=True,
                                            **options)
    (logprobs * rows[3]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


def assert_passes_agree(model, rows, reference: dict, variant: dict):
    """The ``variant`` pass equals the ``reference`` pass: values and entropy on real tokens, every gradient."""
    want, got = pass_and_grads(model, rows, **reference), pass_and_grads(model, rows, **variant)
    mask = rows[3].bool()
    torch.testing.assert_close(got[0][mask], want[0][mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][mask], want[1][mask], atol=2e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys() and want[2]
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def assert_fused_equals_logits(model, rows, share, processing=None):
    common = dict(share_prompts=share, processing=processing)
    assert_passes_agree(model, rows, dict(common, fused_head=False), dict(common, fused_head=True))


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_pass_equals_the_logits_pass(tiny_tokenizer, name, share):
    model = MODELS[name](tiny_tokenizer).train()
    assert_fused_equals_logits(model, grouped_rows(len(tiny_tokenizer), [7, 4, 11], G=3), share)


def test_fused_pass_follows_the_sampling_controls(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).train()
    processing = LogprobProcessing(repetition_penalty=1.3, min_new_tokens=2, min_p=0.05,
                                   eos_ids=(tiny_tokenizer.eos_token_id,))
    assert_fused_equals_logits(model, grouped_rows(len(tiny_tokenizer), [6, 9], G=3), True, processing)


def test_fused_pass_under_gradient_checkpointing(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert_fused_equals_logits(model, grouped_rows(len(tiny_tokenizer), [5, 8], G=2), True)


def test_fused_pass_never_makes_the_micro_batchs_logits(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).train()
    rows = grouped_rows(len(tiny_tokenizer), [7, 4], G=4, Lc=40)
    widths = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    logprobs = completion_logprobs(model, *rows, temperature=1.0, fused_head=True)
    logprobs.sum().backward()
    V = len(tiny_tokenizer)
    chunk = max(1, 2 ** 25 // (8 * V))  # the head's chunk: CHUNK_ELEMENTS // (b V) positions
    assert widths and max(widths) <= min(chunk, 40) and 0 in widths  # the model's own head call sees no position


def test_fused_head_by_size_when_not_set():
    cpu, cuda = pass_defaults("cpu"), pass_defaults("cuda")
    assert (cpu.fused_head_min_elements, cpu.fused_head_min_elements_no_grad) == (2 ** 26, 2 ** 26)
    assert (cuda.fused_head_min_elements, cuda.fused_head_min_elements_no_grad) == (2 ** 26, 2 ** 30)
    least = cpu.fused_head_min_elements
    assert uses_fused_head(None, 16, 1025, 151936) and not uses_fused_head(None, 16, 65, 8448)
    assert uses_fused_head(None, 1, least, 1) and not uses_fused_head(None, 1, least - 1, 1)
    # CUDA's no-grad passes keep the plain logits up to 2^30 elements (the H200's reference pass at 16 x 257
    # positions of Qwen's vocabulary: plain was faster); its training passes fuse from 2^26, as a CPU's
    assert not uses_fused_head(None, 16, 257, 151936, "cuda", grad=False)
    assert uses_fused_head(None, 16, 257, 151936, "cuda") and uses_fused_head(None, 16, 257, 151936, "cpu", grad=False)
    assert uses_fused_head(None, 1, 2 ** 30, 1, "cuda", grad=False)
    assert uses_fused_head(None, 1, least, 1, "meta", grad=False)  # other device types: the CPU's
    assert uses_fused_head(True, 1, 1, 1, "cuda", grad=False) and not uses_fused_head(False, 16, 1025, 151936)


def test_the_planner_sizes_the_fused_head_as_the_passes_run_it():
    # grpo memory imports no torch, so it repeats the head's chunk: it must agree with the code's
    from grpo.algorithm.head import CHUNK_ELEMENTS
    from grpo.commands.memory import formulas

    assert formulas.HEAD_CHUNK_ELEMENTS == CHUNK_ELEMENTS
    for device in ("cpu", "cuda"):  # the planner sizes the update: a pass with gradients
        for setting in (None, True, False):
            for shape in ((16, 1025, 151936), (16, 257, 151936), (16, 65, 8448), (1, 442, 151936)):
                assert formulas.fused_head(setting, micro_batch=shape[0], positions=shape[1], vocab_size=shape[2],
                                           device_type=device) == uses_fused_head(setting, *shape, device)
