"""grpo.models.logits_head: the fused LM head gives the log-probs of the model's own forward for families
that scale or soft-cap the logits after the head (Gemma 2/3, Cohere, Granite: up to 0.2 nats off before),
and a forward that does something else keeps its own logits, or is a clear error when the fused head is
asked for by name."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grpo.models.logits_head import head_reproduces_forward
from grpo.step.logprobs import _fusable, completion_logprobs

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def families():
    return {
        "gemma2 (final_logit_softcapping)": Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16,
                                                                           final_logit_softcapping=0.5)),
        "cohere (logit_scale)": CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.25)),
        "granite (logits_scaling)": GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=4.0)),
    }


class TripledLogits(Qwen2ForCausalLM):
    """A forward that changes the logits after its head in a way logits_head does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.logits is not None:
            out.logits = out.logits * 3
        return out


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, completions = torch.randint(3, 300, (4, 6), generator=g), torch.randint(3, 300, (4, 5), generator=g)
    return prompts, torch.ones_like(prompts), completions, torch.ones_like(completions)


@pytest.mark.parametrize("name", list(families()))
def test_fused_head_equals_the_models_own_logits(name):
    torch.manual_seed(0)
    model = families()[name].train()
    assert head_reproduces_forward(model) and model.training  # the probe leaves the mode as it was
    rows = batch()
    plain = completion_logprobs(model, *rows, 0.7, fused_head=False, share_prompts=False)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    fused = completion_logprobs(model, *rows, 0.7, fused_head=True, share_prompts=False)
    fused.sum().backward()
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_an_unknown_change_after_the_head_keeps_the_models_logits_or_is_an_error_naming_the_key():
    torch.manual_seed(0)
    model = TripledLogits(Qwen2Config(**SMALL)).eval()
    assert not head_reproduces_forward(model)
    assert _fusable(model, None) is False  # by size: the model's own logits
    with pytest.raises(ValueError, match=r"train\.fused_lm_head is true, but TripledLogits's forward changes"):
        completion_logprobs(model, *batch(), 1.0, fused_head=True)
    plain = Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    assert head_reproduces_forward(plain) and _fusable(plain, True)
