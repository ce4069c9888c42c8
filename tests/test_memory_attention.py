"""``grpo memory``'s attention-mask and fused-LM-head terms against autograd and the profiler on tiny CPU models:
one unpadded row keeps no [s, s] mask (transformers passes SDPA ``is_causal``), packed rows keep one mask over
the whole packed sequence, and the fused head's backward holds four float32 chunks of logits."""

from __future__ import annotations

import pytest
import torch
from memory_helpers import saved_bytes
from test_memory import _tiny

from grpo.commands.memory.formulas import activation_bytes, fused_logits_bytes, sdpa_mask_keys


def _kept_and_counts(model, shape, dtype, ids, position_ids, micro_batch, seq_len, packed):
    """(bytes autograd keeps, the count with ``sdpa_mask_keys``, the count taking the rows as padded)."""
    kept = saved_bytes(model, lambda: model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=1))
    p = 2 if dtype == torch.bfloat16 else 4
    common = dict(micro_batch=micro_batch, seq_len=seq_len, p=p, lora_targets=None, lora_r=8, attention="sdpa",
                  gradient_checkpointing=False, logits=10**12)  # huge logits: the saved tensors alone
    keys = sdpa_mask_keys(micro_batch=micro_batch, seq_len=seq_len, packed=packed)
    return kept, activation_bytes(shape, **common, mask_keys=keys), activation_bytes(shape, **common)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_unpadded_row_keeps_no_attention_mask(tiny_tokenizer, dtype):
    # grpo.step.logprobs gives one row without padding (its padding columns dropped): no [s, s] mask, and
    # k, v at kv width (GQA inside SDPA); the padded count (p x s per token per layer) would be 19% high.
    model, shape = _tiny(tiny_tokenizer, dtype, False, "all-linear")
    ids = torch.randint(3, shape.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    kept, counted, padded = _kept_and_counts(model, shape, dtype, ids, torch.arange(512)[None], 1, 512, False)
    # left out by the count, 1.0-1.2% here: RoPE cos/sin, SDPA's logsumexp, the norms' rsqrt, the ids
    assert counted == pytest.approx(kept, rel=0.015)
    assert padded > 1.15 * kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_keep_one_mask_over_the_packed_sequence(tiny_tokenizer, dtype):
    # Two rows of 256 tokens packed as grpo.step.logprobs._packed_scores runs them (positions restart, no mask
    # given): transformers builds a block-diagonal [1, 1, 512, 512] mask, which every sdpa layer keeps.
    model, shape = _tiny(tiny_tokenizer, dtype, False, "all-linear")
    ids = torch.randint(3, shape.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(256).repeat(2)[None]  # [1, 512]
    kept, counted, padded = _kept_and_counts(model, shape, dtype, ids, positions, 2, 256, True)
    assert counted == pytest.approx(kept, rel=0.01)
    assert padded < 0.95 * kept  # a row's own [s, s] mask is half the packed one's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_backward_holds_four_float32_chunks(monkeypatch, dtype):
    # head_logprobs over 2 x 300 positions of a 4,096-token vocabulary, chunks of 2^18 logits (32 positions x
    # 2 rows): the profiler's peak over forward and backward is fused_logits_bytes (16 B per chunk logit, in
    # either dtype) + the head's weight gradient, to within the hidden states' gradient and the log-probs.
    from torch.profiler import ProfilerActivity, profile

    from grpo.algorithm import head as head_module
    from grpo.commands.memory import formulas

    monkeypatch.setattr(head_module, "CHUNK_ELEMENTS", 2 ** 18)
    monkeypatch.setattr(formulas, "HEAD_CHUNK_ELEMENTS", 2 ** 18)
    B, L, H, V = 2, 300, 16, 4096
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    hidden = torch.randn(B, L, H, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, V, (B, L), generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logprobs, _ = head_module.head_logprobs(hidden, head, targets, 1.0, vocab_size=V)
        logprobs.sum().backward()
    live = peak = 0
    for _, change in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += change
        peak = max(peak, live)
    expected = fused_logits_bytes(micro_batch=B, positions=L, vocab_size=V) + V * H * head.weight.element_size()
    assert fused_logits_bytes(micro_batch=B, positions=L, vocab_size=V) == 16 * B * 32 * V
    assert expected == pytest.approx(peak, rel=0.03)
