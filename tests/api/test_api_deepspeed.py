"""TRL's ``deepspeed=`` (a JSON file or the config as a dict) runs grpo's DeepSpeed learner, and one process without
a launcher (one GPU, a notebook, this CPU) can run it: grpo gives DeepSpeed the one-process group and LOCAL_RANK it
asks for, and takes LOCAL_RANK back afterwards."""

from __future__ import annotations

import json
import os

import pytest

from grpo.api import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError, load_config

ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}


def test_deepspeed_is_a_file_or_a_mapping_both_ways(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO2))
    for value in (str(path), ZERO2):
        cfg = GRPOConfig(deepspeed=value, use_cpu=True, max_steps=1).to_run_config()
        assert cfg.train.deepspeed == value
        assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg
    assert load_config(None, ["train.deepspeed={zero_optimization: {stage: 3}}"]).train.deepspeed == {
        "zero_optimization": {"stage": 3}}


@pytest.mark.slow
def test_one_process_trains_under_deepspeed_from_a_mapping(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from datasets import Dataset

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(8)]

    def has_digit(completions, **kwargs):
        return [float(any(ch.isdigit() for ch in c[0]["content"])) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=2, save_steps=2, use_cpu=True, bf16=False,
                      gradient_checkpointing=False, report_to="none", disable_tqdm=True, deepspeed=ZERO2)
    trainer = GRPOTrainer(str(tiny_model_dir), reward_funcs=has_digit, args=args, train_dataset=Dataset.from_list(rows))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert trainer.train().global_step == 2
    assert (tmp_path / "run" / "deepspeed-step-2").is_dir()  # the engine's own checkpoint beside TRL's
    assert any(not (p.detach() == before[n]).all() for n, p in trainer.model.named_parameters())
    assert "LOCAL_RANK" not in os.environ  # lent to DeepSpeed's engine only
    bad = dict(ZERO2, train_micro_batch_size_per_gpu=3)
    with pytest.raises(ConfigError, match=r"train.deepspeed: the given mapping: train_micro_batch_size_per_gpu is 3 "
                                          r"but the run needs 4"):
        GRPOTrainer(str(tiny_model_dir), reward_funcs=has_digit, train_dataset=Dataset.from_list(rows),
                    args=GRPOConfig(**{**args.__dict__, "deepspeed": bad, "extra": {}})).train()
