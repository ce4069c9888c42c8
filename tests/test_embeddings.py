"""grpo.models.embeddings: the LM head in float32 (TRL's cast_lm_head_to_fp32) under bf16 autocast, in every pass and
in every copy of the model a run makes, and NEFTune's noise as transformers adds it."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.models.loading import load_reference, prepare_policy
from grpo.models.tiny import build_qwen2
from grpo.rollout.sampling_copy import SamplingCopy
from grpo.step.logprobs import completion_logprobs


def _policy(tiny_tokenizer, *overrides, tied=False):
    cfg = load_config(None, [*overrides])
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0, tie_word_embeddings=tied)
    return prepare_policy(model, cfg.model), cfg


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_runs_in_float32_under_bf16_autocast(tiny_tokenizer, tied):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    fp32, cfg = _policy(tiny_tokenizer, "model.lm_head_fp32=true", tied=tied)
    plain, _ = _policy(tiny_tokenizer, tied=tied)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp32(ids, output_hidden_states=True)
        rounded = plain(ids).logits
    head = fp32.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and out.logits.dtype == torch.float32
    want = out.hidden_states[-1].float() @ head.weight.T  # [1, 5, V]: the body's output through the fp32 head
    assert torch.allclose(out.logits, want, atol=1e-6)
    assert (rounded.float() - want).abs().max() > 1e-3  # the bf16 head's logits are not these
    # the fused head calls the same module: its log-probs are the plain pass's
    args = (ids[:, :2], torch.ones(1, 2, dtype=torch.long), ids[:, 2:], torch.ones(1, 3, dtype=torch.long), 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = completion_logprobs(fp32, *args, fused_head=True, share_prompts=False)
        logits = completion_logprobs(fp32, *args, fused_head=False, share_prompts=False)
    assert torch.allclose(fused, logits, atol=1e-5)
    if tied:  # the tied embeddings' outputs stay the model's dtype
        assert fp32.get_input_embeddings()(ids).dtype == fp32.get_input_embeddings().weight.dtype


def test_every_copy_of_the_policy_keeps_the_float32_head(tiny_tokenizer):
    policy, cfg = _policy(tiny_tokenizer, "model.lm_head_fp32=true", "model.bf16=true", "model.lora_r=0")
    reference = load_reference(cfg.model, policy, tiny_tokenizer, torch.device("cpu"))  # the policy's dtype: bf16
    assert reference.get_output_embeddings().weight.dtype == torch.float32
    assert reference.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    sampler = SamplingCopy(policy, torch.bfloat16).model
    assert sampler.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7]])
    assert sampler(ids).logits.dtype == torch.float32  # its forward is the float32 one, bound to the copy's head
    assert copy.deepcopy(policy).get_output_embeddings().forward.__self__ is not policy.get_output_embeddings()


def test_a_head_lora_adapts_is_refused(tiny_tokenizer):
    with pytest.raises(ConfigError, match=r"model.lm_head_fp32: the LM head carries a LoRA adapter"):
        _policy(tiny_tokenizer, "model.lm_head_fp32=true", "model.lora_r=4",
                "model.lora_target_modules=[q_proj, lm_head]")


def test_neftune_adds_transformers_noise_in_training_mode_only(tiny_tokenizer):
    policy, _ = _policy(tiny_tokenizer, "model.neftune_noise_alpha=5.0")
    plain, _ = _policy(tiny_tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    clean = plain.get_input_embeddings()(ids)  # [1, 4, H]
    torch.manual_seed(3)
    noisy = policy.get_input_embeddings()(ids)
    torch.manual_seed(3)
    magnitude = 5.0 / torch.sqrt(torch.tensor(4 * clean.shape[-1]))  # transformers' alpha / sqrt(L x H)
    assert torch.equal(noisy, clean + torch.zeros_like(clean).uniform_(-magnitude, magnitude))
    policy.eval()
    assert torch.equal(policy.get_input_embeddings()(ids), clean)  # sampling (eval mode) sees none
