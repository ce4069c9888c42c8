"""grpo.algorithm.tokens: token_logprobs against a slow plain-Python reference and a hand-computed case (its
chunked backward: test_token_logprobs_chunked.py)."""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import ref_token_logprobs
from grpo.algorithm import token_logprobs


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_matches_loop_reference(seed, temperature):
    gen = torch.Generator().manual_seed(seed)
    B, T, V = 3, 6, 11
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (B, T), generator=gen)
    got = token_logprobs(logits, ids, temperature)
    want = torch.tensor(ref_token_logprobs(logits.tolist(), ids.tolist(), temperature), dtype=torch.float64)
    assert got.shape == (B, T - 1)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)  # float32 math inside


def test_token_logprobs_does_not_modify_logits_and_has_gradient():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    before = logits.detach().clone()
    ids = torch.randint(0, 7, (2, 5))
    out = token_logprobs(logits, ids, temperature=0.5)
    out.sum().backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_token_logprobs_uniform_logits_hand_computed():
    # Equal logits over V = 4 tokens: every token has log(1/4) whatever the temperature.
    out = token_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 3]]), temperature=0.3)
    assert torch.allclose(out, torch.full((1, 2), math.log(0.25)))
