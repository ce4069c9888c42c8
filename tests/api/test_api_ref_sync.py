"""TRL's sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps under GRPOTrainer: the reference TR-DPO
moves after each sync step's update, as TRL's SyncRefModelCallback moves it, kept in checkpoints so that a resumed
run continues it; refused where TRL refuses it (beta 0, PEFT) with TRL's reason."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer
from test_api_trainer import Recorder, args_for, length_reward, load, rows

SYNC = dict(sync_ref_model=True, beta=0.5, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, save_steps=1)


def _model_with(weights: dict[str, torch.Tensor], like: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(like)
    model.load_state_dict(weights, strict=False)  # a tied lm_head is saved once
    return model


def test_the_reference_moves_at_sync_steps_as_trls_callback_moves_it(tiny_model_dir, tmp_path):
    from trl.trainer.callbacks import SyncRefModelCallback

    out = tmp_path / "run"
    trainer = GRPOTrainer(load(tiny_model_dir), length_reward, args_for(out, **SYNC), train_dataset=rows())
    assert (trainer.config.loss.ref_sync_steps, trainer.config.loss.ref_mixup_alpha) == (2, 0.5)
    trainer.train()
    # TRL's callback on the same tensors: the initial weights, moved toward the policy of steps 2 and 4
    expected = load(tiny_model_dir)
    for step in (1, 2, 3, 4):
        policy = _model_with(load_file(str(out / f"checkpoint-{step}" / "model.safetensors")), expected)
        if step % 2 == 0:
            SyncRefModelCallback._sync_target_model(policy, expected, 0.5)
        saved = _model_with(load_file(str(out / f"checkpoint-{step}" / "reference" / "model.safetensors")), expected)
        assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), expected.parameters())), step
    assert any(e.get("kl", 0) > 0 for e in trainer.state.log_history)  # the reference is in the loss


def test_under_peft_the_reference_moves_toward_the_merged_policy(tiny_model_dir, tmp_path):
    """TRL refuses sync_ref_model with PEFT (its reference is the adapter switched off); grpo keeps a copy of the
    base for it and mixes it toward the policy's merged weights (base + the adapter's delta) at each sync step."""
    from peft import LoraConfig, PeftModel

    out = tmp_path / "run"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(load(tiny_model_dir), length_reward, args_for(out, **SYNC, max_steps=2),
                          train_dataset=rows(), peft_config=lora)
    assert trainer.config.model.lora_r == 4 and trainer.config.loss.ref_sync_steps == 2
    trainer.train()
    first = _model_with(load_file(str(out / "checkpoint-1" / "reference" / "model.safetensors")), load(tiny_model_dir))
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), load(tiny_model_dir).parameters()))  # not synced
    merged = PeftModel.from_pretrained(load(tiny_model_dir), str(out / "checkpoint-2")).merge_and_unload()
    expected = load(tiny_model_dir)
    from trl.trainer.callbacks import SyncRefModelCallback

    SyncRefModelCallback._sync_target_model(merged, expected, 0.5)  # TRL's mix, toward the merged policy
    saved = _model_with(load_file(str(out / "checkpoint-2" / "reference" / "model.safetensors")), expected)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(saved.parameters(), expected.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(saved.parameters(), load(tiny_model_dir).parameters()))


def test_a_resumed_run_continues_the_moved_reference(tiny_model_dir, tmp_path):
    straight = GRPOTrainer(load(tiny_model_dir), length_reward, args_for(tmp_path / "a", **SYNC), train_dataset=rows())
    straight.train()
    GRPOTrainer(load(tiny_model_dir), length_reward, args_for(tmp_path / "b", **SYNC), train_dataset=rows(),
                callbacks=[Recorder(stop_at=3)]).train()  # stopped after the sync of step 2 and one more step
    resumed = GRPOTrainer(load(tiny_model_dir), length_reward, args_for(tmp_path / "b", **SYNC), train_dataset=rows())
    resumed.train(resume_from_checkpoint=True)
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)  # step 4's KL was to the moved reference both times
    kl = [[e["kl"] for e in t.state.log_history if "kl" in e] for t in (straight, resumed)]
    assert kl[0][-1] == kl[1][-1]


def test_sync_ref_model_is_refused_where_trl_refuses_it(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="loss.beta is 0: there is no reference to move"):
        args_for(tmp_path / "run", sync_ref_model=True).to_run_config()
    with pytest.raises(ValueError, match="ref_model_sync_steps=3 is not a multiple of the updates per generation 2"):
        args_for(tmp_path / "run", **{**SYNC, "ref_model_sync_steps": 3}, num_iterations=2).to_run_config()
    # alpha alone changes nothing under TRL: accepted, and not a key of the run
    assert args_for(tmp_path / "run", ref_model_mixup_alpha=0.9).to_run_config().loss.ref_sync_steps is None
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    with pytest.raises(ValueError, match="sync_ref_model=True` while `beta=0.0`"):  # TRL's own refusal
        trl.GRPOTrainer(model=str(tiny_model_dir), reward_funcs=length_reward, train_dataset=Dataset.from_list(rows(8)),
                        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), sync_ref_model=True, beta=0.0,
                                            use_cpu=True, report_to="none", per_device_train_batch_size=8,
                                            num_generations=4, max_steps=1))
    assert GRPOConfig.from_run_config(args_for(tmp_path / "run", **SYNC).to_run_config()).sync_ref_model
