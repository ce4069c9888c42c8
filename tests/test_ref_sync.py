"""grpo.step.ref_sync: TR-DPO's moving reference computed as TRL's SyncRefModelCallback computes it, on the
steps it names, and the rules that keep it to a reference this process holds."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.models.tiny import build_qwen2
from grpo.step.ref_sync import RefSync, load_saved_reference, mix_into_reference, save_reference


def _models(tiny_tokenizer, ref_dtype=torch.float32):
    policy = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    reference = copy.deepcopy(policy).to(ref_dtype)
    with torch.no_grad():  # the policy has moved since the copy
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return policy, reference


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16])  # model.ref_torch_dtype may differ
def test_the_mix_is_trls_sync_target_model_on_the_same_tensors(tiny_tokenizer, ref_dtype):
    from trl.trainer.callbacks import SyncRefModelCallback

    policy, reference = _models(tiny_tokenizer, ref_dtype)
    theirs = copy.deepcopy(reference)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    mix_into_reference(reference, policy, 0.3)
    SyncRefModelCallback._sync_target_model(policy, theirs, 0.3)
    ours, want = reference.state_dict(), theirs.state_dict()
    assert all(torch.equal(ours[k], want[k]) for k in want)
    # and it is the mixture: 0.3 of the policy, 0.7 of the reference before (to the reference dtype's rounding)
    name = "model.layers.0.mlp.up_proj.weight"
    expected = 0.3 * policy.state_dict()[name].float() + 0.7 * before[name].float()
    assert torch.allclose(ours[name].float(), expected, atol=1e-6 if ref_dtype == torch.float32 else 1e-2)


def test_the_reference_moves_only_on_sync_steps_and_round_trips_a_checkpoint(tiny_tokenizer, tmp_path):
    policy, reference = _models(tiny_tokenizer)
    sync = RefSync(reference, policy, alpha=1.0, every=3)  # alpha 1: the reference becomes the policy
    assert [sync(step) for step in (1, 2)] == [False, False]
    assert not torch.equal(reference.lm_head.weight, policy.lm_head.weight)
    assert sync(3) and all(torch.equal(a, b) for a, b in zip(reference.parameters(), policy.parameters()))
    save_reference(tmp_path, reference)
    fresh = copy.deepcopy(_models(tiny_tokenizer)[1])
    assert load_saved_reference(tmp_path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), reference.parameters()))
    assert not load_saved_reference(tmp_path / "elsewhere", fresh)  # none saved: the reference stays


def test_under_lora_the_base_copy_moves_toward_the_merged_policy(tiny_tokenizer):
    """A LoRA run's moving reference starts as the base without the adapter (load_reference(moving=True): the values
    of the adapter switched off) and is mixed toward the policy's effective weights, base + B @ A x scale, as
    TR-DPO mixes a full copy toward the policy: the same as mixing toward peft's merged model."""
    from peft import LoraConfig, get_peft_model

    from grpo.config import ModelConfig
    from grpo.models.loading import load_reference, reference_context

    base = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    reference = load_reference(ModelConfig(lora_r=4), policy, tiny_tokenizer, torch.device("cpu"), moving=True)
    ids = torch.tensor([[3, 5, 7, 9]])
    with reference_context(policy, None) as switched_off:  # the frozen reference a LoRA run has without sync
        assert torch.equal(reference(ids).logits, switched_off(ids).logits)
    with torch.no_grad():  # the adapter has trained: B is no longer 0
        for name, param in policy.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    mix_into_reference(reference, policy, 0.3)
    after = reference.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight"):
        assert torch.allclose(after[name], 0.3 * merged[name] + 0.7 * before[name], atol=1e-6), name
    assert not torch.allclose(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    assert not any("lora_" in name for name in after)


@pytest.mark.parametrize("overrides, match", [
    (["loss.beta=0"], "loss.beta is 0"),
    (["model.lora_r=4", "model.load_in_4bit=true"], "model.load_in_4bit is set: the moving reference"),
    (["model.ref_name_or_path=teacher"], "model.ref_name_or_path names a teacher"),
    (["train.mode=decoupled"], "train.mode is decoupled: the samplers .* hold the reference"),
    (["train.deepspeed=ds.json"], "train.deepspeed is set: under ZeRO-3"),
])
def test_a_reference_the_run_cannot_move_is_refused_with_the_reason(overrides, match):
    with pytest.raises(ConfigError, match=f"loss.ref_sync_steps is set but {match}"):
        load_config(None, ["loss.ref_sync_steps=2", "loss.beta=0.04", *overrides])
    with pytest.raises(ConfigError, match="loss.ref_mixup_alpha is set but loss.ref_sync_steps is null"):
        load_config(None, ["loss.ref_mixup_alpha=0.9"])
    assert load_config(None, ["loss.ref_sync_steps=2", "loss.beta=0.04"]).loss.ref_sync_steps == 2
