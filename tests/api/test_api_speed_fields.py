"""TRL's speed fields through the Python API (issue 58): fp16, tf32, torch_compile(_backend/_mode), use_liger_kernel
and liger_kernel_config map onto grpo's keys both ways, and what grpo cannot do is refused in TRL's words."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments

import grpo.api.trl_fields
from grpo import GRPOConfig, GRPOTrainer
from grpo.api.trl_fields import LIGER_NOTE
from grpo.config import ConfigError, load_config

NO_TF32_GPU = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8,
                                 reason="this machine has a TF32 GPU")


def run_config(**kwargs):
    return GRPOConfig(**{"use_cpu": True, "max_steps": 1, **kwargs}).to_run_config()


def test_fp16_is_model_fp16_and_turns_the_bf16_default_off():
    cfg = run_config(fp16=True)
    assert (cfg.model.fp16, cfg.model.bf16) == (True, False)
    # TRL's bf16=None is `not fp16`: even where CUDA has bf16, fp16=True must not also turn bf16 on
    cfg = GRPOConfig(fp16=True, max_steps=1).to_run_config()
    assert (cfg.model.fp16, cfg.model.bf16) == (True, False)
    with pytest.raises(ValueError, match="at most one of fp16 and bf16"):
        GRPOConfig(fp16=True, bf16=True)


@NO_TF32_GPU
def test_tf32_on_a_machine_without_a_tf32_gpu_is_refused_as_transformers_refuses_it(tmp_path):
    with pytest.raises(ValueError) as theirs:
        TrainingArguments(output_dir=str(tmp_path), tf32=True, use_cpu=True)
    with pytest.raises(ValueError) as ours:
        GRPOConfig(tf32=True, use_cpu=True)
    assert str(theirs.value) in str(ours.value)  # transformers' own words, after the field's name
    assert "GRPOConfig.tf32=True" in str(ours.value)
    assert run_config(tf32=False).model.tf32 is False  # off needs no GPU (nothing to switch off)


def test_tf32_on_a_tf32_gpu_still_refuses_use_cpu_with_its_reason(monkeypatch):
    # transformers accepts tf32=True with use_cpu=True on an Ampere machine and the flag does nothing; grpo's
    # config refuses it: the run is on the CPU
    monkeypatch.setattr("grpo.api.arguments.tf32_available", lambda: True)
    with pytest.raises(ConfigError, match="model.tf32 is true but train.device is cpu"):
        run_config(tf32=True)


def test_torch_compile_fields_are_the_train_keys_and_a_backend_or_mode_turns_it_on():
    cfg = run_config(torch_compile=True)
    assert (cfg.train.torch_compile, cfg.train.torch_compile_backend, cfg.train.torch_compile_mode) == (True, None,
                                                                                                      None)
    cfg = run_config(torch_compile_backend="aot_eager")  # transformers: setting one turns torch_compile on
    assert (cfg.train.torch_compile, cfg.train.torch_compile_backend) == (True, "aot_eager")
    assert run_config(torch_compile_mode="max-autotune").train.torch_compile
    assert run_config(torch_compile=False).train.torch_compile is False


def test_torch_compile_turns_tf32_on_where_transformers_does(monkeypatch):
    # TrainingArguments: tf32 None + torch_compile on a TF32 GPU (and not fp16) enables TF32
    monkeypatch.setattr(grpo.api.trl_fields, "tf32_available", lambda: True)
    assert GRPOConfig(torch_compile=True, max_steps=1).to_run_config().model.tf32 is True
    assert GRPOConfig(torch_compile=True, fp16=True, max_steps=1).to_run_config().model.tf32 is None
    assert GRPOConfig(torch_compile=True, tf32=False, max_steps=1).to_run_config().model.tf32 is False
    assert run_config(torch_compile=True).model.tf32 is None  # use_cpu: nothing to turn on (and no refusal)
    monkeypatch.setattr(grpo.api.trl_fields, "tf32_available", lambda: False)
    assert GRPOConfig(torch_compile=True, max_steps=1).to_run_config().model.tf32 is None


def test_use_liger_kernel_is_the_fused_lm_head_and_a_liger_kernel_config_asking_for_kernels_is_refused():
    assert run_config(use_liger_kernel=True).train.fused_lm_head is True
    assert run_config().train.fused_lm_head is None  # off: grpo's by-size default
    assert run_config(use_liger_kernel=True, liger_kernel_config={"rope": False}).train.fused_lm_head is True
    for config in ({"fused_linear_cross_entropy": True}, {"rope": True, "swiglu": False}):
        with pytest.raises(ValueError, match=r"liger_kernel_config \[.*\] is not supported"):
            GRPOConfig(use_liger_kernel=True, liger_kernel_config=config)


def test_use_liger_kernel_says_once_what_runs_instead(tiny_model_dir, tmp_path, capsys):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), use_liger_kernel=True, use_cpu=True, max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, report_to="none")
    trainer = GRPOTrainer(str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=[{"prompt": "1 + 1 = ?"}] * 4)
    assert capsys.readouterr().out.count(LIGER_NOTE) == 1
    assert trainer.config.train.fused_lm_head is True


def test_a_recipe_with_the_speed_keys_round_trips(tmp_path):
    recipe = tmp_path / "speed.yaml"
    recipe.write_text("model: {fp16: true, tf32: false}\n"
                      "train: {torch_compile: true, torch_compile_backend: aot_eager, fused_lm_head: true}\n")
    cfg = load_config(recipe)
    args = GRPOConfig.from_run_config(cfg)
    assert (args.fp16, args.tf32, args.torch_compile, args.torch_compile_backend) == (True, False, True, "aot_eager")
    assert args.to_run_config() == cfg
