"""TRL's disable_dropout (model.disable_dropout) and transformers' full_determinism (train.full_determinism), as
TRL and transformers do them: the same modules at rate 0 as TRL's disable_dropout_in_model, the same process
state as transformers' enable_full_determinism."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from test_api_trainer import args_for, digit_reward, load, rows


def _dropout_rates(model: torch.nn.Module) -> dict[str, float]:
    return {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}


def test_disable_dropout_zeroes_the_modules_trls_does_on_the_policy_and_a_teacher(tiny_model_dir, tiny_tokenizer,
                                                                                   tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl.trainer.utils import disable_dropout_in_model

    from grpo.config.schema import ModelConfig
    from grpo.models.loading import load_reference, prepare_policy

    lora = dict(lora_r=4, lora_alpha=8.0, lora_dropout=0.3, lora_target_modules=["q_proj", "v_proj"])
    kept = prepare_policy(load(tiny_model_dir), ModelConfig(**lora))
    assert _dropout_rates(kept) and set(_dropout_rates(kept).values()) == {0.3}  # LoRA's own dropout modules
    disabled = prepare_policy(load(tiny_model_dir), ModelConfig(**lora, disable_dropout=True))
    disable_dropout_in_model(kept)  # TRL's, after its peft wrap as here
    assert _dropout_rates(disabled) == _dropout_rates(kept) and set(_dropout_rates(disabled).values()) == {0}
    # a teacher reference (GPT-2 has Dropout modules of its own) sharing the policy's tokenizer
    teacher = tmp_path / "teacher"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_layer=1, n_embd=32, n_head=2)).save_pretrained(teacher)
    tiny_tokenizer.save_pretrained(teacher)
    cfg = ModelConfig(ref_name_or_path=str(teacher), disable_dropout=True)
    reference = load_reference(cfg, disabled, tiny_tokenizer, torch.device("cpu"))
    assert _dropout_rates(reference) and set(_dropout_rates(reference).values()) == {0}
    reference = load_reference(ModelConfig(ref_name_or_path=str(teacher)), disabled, tiny_tokenizer,
                               torch.device("cpu"))
    assert set(_dropout_rates(reference).values()) == {0.1}  # GPT-2's own rate without the switch


def test_grpoconfig_disable_dropout_gives_a_policy_whose_training_passes_agree(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for disable in (False, True):
        trainer = GRPOTrainer(load(tiny_model_dir), digit_reward, args_for(tmp_path / "run", disable_dropout=disable),
                              train_dataset=rows(), peft_config=lora)
        assert trainer.config.model.disable_dropout is disable
        with torch.no_grad():  # lora_B starts at 0: give the adapter an output for its dropout to change
            for name, param in trainer.model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.5)
        trainer.model.train()
        torch.manual_seed(0)
        first, second = (trainer.model(ids).logits for _ in range(2))
        assert torch.equal(first, second) is disable, disable  # dropout on: two training passes differ
    args = GRPOConfig(max_steps=1, use_cpu=True, disable_dropout=True)
    assert GRPOConfig.from_run_config(args.to_run_config()).disable_dropout is True


@pytest.fixture
def restored_determinism(monkeypatch):
    """Whatever a test turns on for the process (torch's flags, the CUDA variables) is put back after it."""
    for name in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
                 "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)  # records the value to restore
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2:]


def _process_state() -> dict:
    names = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC")
    return {"env": {n: os.environ.get(n) for n in names}, "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            "draws": (random.random(), float(np.random.rand()), float(torch.rand(1)))}


def test_full_determinism_sets_the_process_state_transformers_sets(restored_determinism):
    from transformers.trainer_utils import enable_full_determinism

    from grpo.training.prepare import seed_process

    seed_process(7, full_determinism=False)
    plain = _process_state()
    assert not plain["deterministic"] and plain["env"]["CUBLAS_WORKSPACE_CONFIG"] is None
    seed_process(7, full_determinism=True)
    ours = _process_state()
    torch.use_deterministic_algorithms(False)
    for name in ours["env"]:
        os.environ.pop(name, None)
    enable_full_determinism(7)
    assert ours == _process_state()
    assert ours["deterministic"] and ours["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_run_with_full_determinism_trains_and_repeats_itself(tiny_model_dir, tmp_path, restored_determinism):
    weights = []
    for name in ("a", "b"):
        trainer = GRPOTrainer(load(tiny_model_dir), digit_reward,
                              args_for(tmp_path / name, full_determinism=True, max_steps=2), train_dataset=rows())
        assert torch.are_deterministic_algorithms_enabled()  # from the constructor on, as Trainer's
        assert trainer.config.train.full_determinism
        trainer.train()  # every op the run uses has a deterministic implementation (else a RuntimeError)
        weights.append(trainer.model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
