"""The per-device-type choices the GPU benchmarks switch (issue 15): which SDPA backends the trainer's
passes use (``grpo.models.loading.SDPA_BACKENDS``) and whether the log-prob passes share prompts
(``grpo.step.logprobs.SHARED_PROMPT_PASS``). Their CUDA values are to be decided by measurement; here, that
each switch does what it says (on the CPU) and that the defaults leave today's behaviour alone."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import grpo.models.loading
import grpo.step.logprobs
from grpo.config import load_config
from grpo.models.loading import compute_context, sdpa_backends


def attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_sdpa_backend_names_are_checked():
    assert sdpa_backends(None) is None and sdpa_backends("auto") is None
    assert sdpa_backends("efficient, math") == ("EFFICIENT_ATTENTION", "MATH")
    assert sdpa_backends("cudnn,FLASH_ATTENTION") == ("CUDNN_ATTENTION", "FLASH_ATTENTION")
    with pytest.raises(ValueError, match="unknown.*'FAST'"):
        sdpa_backends("fast")
    with pytest.raises(ValueError, match="none given"):
        sdpa_backends(",")


def test_compute_context_applies_the_device_types_backends(monkeypatch):
    cfg = load_config(None, []).model
    q = torch.randn(1, 2, 5, 8)
    expected = attention(q)
    assert isinstance(compute_context(cfg, torch.device("cpu"), False), nullcontext)  # nothing set: as before
    monkeypatch.setitem(grpo.models.loading.SDPA_BACKENDS, "cpu", ("EFFICIENT_ATTENTION",))  # no CPU kernel of its own
    only_efficient = compute_context(cfg, torch.device("cpu"), False)
    with only_efficient, pytest.raises(RuntimeError, match="[Nn]o (available kernel|viable backend)"):
        attention(q)
    assert torch.equal(attention(q), expected)  # left: torch's choice again
    monkeypatch.setitem(grpo.models.loading.SDPA_BACKENDS, "cpu", ("MATH",))
    math_only = compute_context(cfg, torch.device("cpu"), False)
    with math_only:  # re-enterable and nestable, as the trainer enters its context more than once
        with math_only:
            torch.testing.assert_close(attention(q), expected)
        torch.testing.assert_close(attention(q), expected)
    with math_only:
        torch.testing.assert_close(attention(q), expected)


def test_backends_and_autocast_together(monkeypatch):
    cfg = load_config(None, ["model.bf16=true"]).model  # full fine-tuning in bf16: autocast over fp32 weights
    a = torch.randn(4, 4)
    with compute_context(cfg, torch.device("cpu"), False):
        assert (a @ a).dtype == torch.bfloat16
    monkeypatch.setitem(grpo.models.loading.SDPA_BACKENDS, "cpu", ("MATH",))
    with compute_context(cfg, torch.device("cpu"), False):
        assert (a @ a).dtype == torch.bfloat16
        attention(torch.randn(1, 2, 5, 8))
    assert (a @ a).dtype == torch.float32


def test_shared_prompt_pass_follows_the_device_types_choice(monkeypatch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 100, (2, 6), generator=g).repeat_interleave(2, 0)  # 2 groups of 2
    completion = torch.randint(5, 100, (4, 5), generator=g)
    args = (model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), 1.0)
    calls = []
    shared = grpo.step.logprobs._shared_prompt_logits
    monkeypatch.setattr(grpo.step.logprobs, "_shared_prompt_logits", lambda *a: calls.append(1) or shared(*a))
    with torch.no_grad():
        on = grpo.step.logprobs.completion_logprobs(*args)
        assert len(calls) == 1  # the CPU's default: shared
        monkeypatch.setitem(grpo.step.logprobs.SHARED_PROMPT_PASS, "cpu", False)
        off = grpo.step.logprobs.completion_logprobs(*args)
        assert len(calls) == 1  # the plain pass
        forced = grpo.step.logprobs.completion_logprobs(*args, share_prompts=True)  # an explicit argument wins
        assert len(calls) == 2
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(forced, on)
