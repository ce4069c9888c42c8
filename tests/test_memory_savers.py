"""QLoRA (4-bit NF4 base) and 8-bit AdamW: bitsandbytes options for single-GPU users.

On a CPU they are refused with a message naming the key, before the run writes anything; an invalid
combination is a config error; on a CUDA machine with bitsandbytes a QLoRA run trains its adapter
(``-m gpu``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.models.loading import check_memory_savers


def test_4bit_without_lora_is_an_invalid_combination():
    with pytest.raises(ConfigError, match=r"model.load_in_4bit.*needs model.lora_r > 0"):
        load_config(None, ["model.load_in_4bit=true"])


@pytest.mark.parametrize("overrides, key", [
    (["model.load_in_4bit=true", "model.lora_r=8"], "model.load_in_4bit"),
    (["optim.optimizer=adamw_8bit"], "optim.optimizer: adamw_8bit"),
])
def test_bitsandbytes_options_are_refused_on_cpu(overrides, key):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=rf"{key}: .*need a CUDA GPU; this run is on cpu"):
        check_memory_savers(cfg.model, cfg.optim.optimizer, torch.device("cpu"))


def test_a_refused_run_writes_nothing(tiny_model_dir, tmp_path):
    from grpo.training.colocated import train

    out = tmp_path / "run"
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "optim.optimizer=adamw_8bit",
                             "train.device=cpu", f"train.output_dir={out}", "log.report_to=[]"])
    with pytest.raises(ConfigError, match="optim.optimizer"):
        train(cfg)
    assert not out.exists()


def characters_reward(prompts, completions, **kwargs):
    # A random model never writes the format: a reward that differs within every group gives the
    # update a signal (all-equal rewards mean zero advantages, hence no update to check).
    from grpo.rewards.answers import completion_text

    return [float(len(completion_text(c))) for c in completions]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="needs CUDA and bitsandbytes")
def test_qlora_with_8bit_adamw_trains_the_adapter_on_a_gpu(tiny_model_dir, tmp_path):
    from grpo.training.colocated import train

    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.load_in_4bit=true", "model.lora_r=8", "model.bf16=true",
        "optim.optimizer=adamw_8bit", "optim.learning_rate=1e-3", "train.device=cuda", "train.max_steps=2",
        "train.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_completion_length=16",
        "train.micro_batch_size=8", f"train.output_dir={out}", "log.report_to=[]", "log.progress_bar=false",
        "log.plots=false", "rewards=[{name: 'test_memory_savers:characters_reward'}]"])
    result = train(cfg)
    from safetensors.torch import load_file

    adapter = load_file(out / "final" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "the adapter did not train (lora_B starts at 0)"
    assert result.last_step == 2
