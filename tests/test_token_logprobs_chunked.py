"""token_logprobs' chunked log-softmax with its own backward, against plain torch references.

The references: the row loop it replaced (forward), and ``log_softmax(logits.float() / T).gather``
under plain autograd (gradients). Shapes are chosen so that no chunk size divides ``B * (T-1)``.
"""

from __future__ import annotations

import pytest
import torch

from grpo.algorithm import token_logprobs


def loop_token_logprobs(logits, input_ids, temperature):
    """The implementation before chunking: one sequence at a time, plain autograd."""
    rows = []
    for row_logits, row_targets in zip(logits[:, :-1], input_ids[:, 1:]):  # [T-1, V], [T-1]
        scaled = row_logits.float()
        if temperature != 1.0:
            scaled = scaled / temperature
        picked = scaled.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)  # [B, T-1]


def autograd_token_logprobs(logits, input_ids, temperature):
    """A whole-batch float32 log-softmax and gather: what autograd differentiates exactly."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)[:, :-1]  # [B, T-1, V]
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]


def ragged_case(dtype, seed=0, B=3, T=8, V=37):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.tensor([T - 1, 3, 1])[:B]  # ragged completions: padding carries no gradient
    mask = (torch.arange(T - 1)[None] < lengths[:, None]).float()  # [B, T-1]
    weights = torch.randn(B, T - 1, generator=gen) * mask  # an arbitrary upstream gradient
    return logits, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
# B*(T-1) = 21: neither 5 nor 8 divides it; 1000 is one chunk for all. (No chunk size on a CPU would
# pick the row loop.)
@pytest.mark.parametrize("chunk", [1, 5, 8, 1000])
def test_forward_matches_the_row_loop(dtype, temperature, chunk):
    logits, ids, _ = ragged_case(dtype)
    got = token_logprobs(logits, ids, temperature, chunk_tokens=chunk)
    want = loop_token_logprobs(logits, ids, temperature)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 8, 1000])
def test_gradient_matches_plain_autograd(dtype, temperature, chunk):
    logits, ids, weights = ragged_case(dtype)
    grads = []
    for fn in (lambda x: token_logprobs(x, ids, temperature, chunk_tokens=chunk),
               lambda x: autograd_token_logprobs(x, ids, temperature)):
        x = logits.clone().requires_grad_(True)
        (fn(x) * weights).sum().backward()
        assert x.grad.dtype == dtype
        grads.append(x.grad.float())
    got, want = grads
    assert want.abs().max() > 0.1  # a real gradient
    assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))  # the last position predicts nothing
    assert torch.equal(got[1, 3:], torch.zeros_like(got[1, 3:]))  # padded positions get none
    # Both compute in float32, in a different order (a few ulps); bf16 may differ by one rounding of
    # the final cast (2^-8 relative).
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-7, rtol=1e-5), (got - want).abs().max()
    else:
        assert torch.allclose(got, want, atol=2 ** -8 * want.abs().max().item(), rtol=0), (got - want).abs().max()


def test_non_contiguous_logits_and_no_in_place_edit():
    logits, ids, weights = ragged_case(torch.float32, V=40)
    wide = logits.clone().requires_grad_(True)
    sliced = wide[..., :37]  # strides of the 40-wide tensor
    before = wide.detach().clone()
    (token_logprobs(sliced, ids % 37, 0.7, chunk_tokens=4) * weights).sum().backward()
    x = logits[..., :37].clone().requires_grad_(True)
    (autograd_token_logprobs(x, ids % 37, 0.7) * weights).sum().backward()
    assert torch.equal(wide.detach(), before)
    assert torch.allclose(wide.grad[..., :37], x.grad, atol=1e-6, rtol=0)
    assert torch.equal(wide.grad[..., 37:], torch.zeros_like(wide.grad[..., 37:]))


def test_backward_keeps_only_the_logits_and_the_per_token_logsumexp():
    # No float32 copy of [B, T, V] is saved for backward: the logits themselves (the same storage),
    # the targets and one float32 per token.
    logits, ids, _ = ragged_case(torch.bfloat16, B=2, T=9, V=301)
    logits.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits, ids, 0.7, chunk_tokens=5)
    copies = [t for t in saved if t.data_ptr() != logits.data_ptr()]
    assert sum(t.numel() * t.element_size() for t in copies) <= 2 * 8 * (4 + 8)  # lse fp32 + targets int64


def test_a_cpu_runs_the_row_loop_by_default():
    # Chosen by device: the loop was faster on the CPU (see token_logprobs); the result is the loop's.
    logits, ids, _ = ragged_case(torch.bfloat16)
    assert torch.equal(token_logprobs(logits, ids, 0.7), loop_token_logprobs(logits, ids, 0.7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_default_is_chunked_and_matches_autograd(dtype):
    logits, ids, weights = (t.cuda() for t in ragged_case(dtype, V=5000))
    grads = []
    for fn in (token_logprobs, autograd_token_logprobs):
        x = logits.clone().requires_grad_(True)
        out = fn(x, ids, 0.7)
        (out * weights).sum().backward()
        grads.append((out, x.grad.float()))
    (out, got), (want_out, want) = grads
    assert torch.allclose(out, want_out, atol=1e-5, rtol=0)
    assert torch.allclose(got, want, atol=2 ** -8 * want.abs().max().item(), rtol=1e-5)
