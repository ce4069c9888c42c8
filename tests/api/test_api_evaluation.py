"""TRL's evaluation arguments beyond eval_steps: num_generations_eval (the loss pass's completions per prompt)."""

from __future__ import annotations

from collections import Counter

import pytest

from grpo import GRPOConfig, GRPOTrainer
from test_api_trainer import args_for, load, rows


def test_num_generations_eval_is_the_loss_pass_group_size_as_trls(tiny_model_dir, tmp_path):
    groups: list[set[int]] = []

    def recording(completions, prompts, **kwargs):  # each call's completions per prompt
        groups.append(set(Counter(str(p) for p in prompts).values()))
        return [0.0] * len(completions)

    for eval_generations, want in ((2, {1, 2}), (None, {1, 4})):  # 1: the greedy evaluation's; None: num_generations
        groups.clear()
        args = args_for(tmp_path / "run", num_generations_eval=eval_generations, per_device_eval_batch_size=8)
        assert args.to_run_config().eval.num_generations == eval_generations
        trainer = GRPOTrainer(load(tiny_model_dir), recording, args, train_dataset=rows(), eval_dataset=rows(4))
        trainer.evaluate()
        assert set().union(*groups) == want, groups
    cfg = args_for(tmp_path / "run", num_generations_eval=2).to_run_config()
    assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg


def test_the_eval_batch_must_hold_whole_groups_as_trl_requires():
    trl = pytest.importorskip("trl")
    kwargs = dict(per_device_train_batch_size=8, num_generations=4, num_generations_eval=3, eval_strategy="steps",
                  eval_steps=1, per_device_eval_batch_size=8, use_cpu=True, max_steps=2, report_to="none")
    match = r"global eval batch size \(8 \* 1\) must be divisible by the number of generations used for evaluation \(3\)"
    with pytest.raises(ValueError, match=match):
        trl.GRPOConfig(output_dir="unused", **kwargs)
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs).to_run_config()
    GRPOConfig(**{**kwargs, "eval_strategy": "no"}).to_run_config()  # TRL checks it only when evaluating


def test_eval_num_generations_needs_the_loss_pass():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.num_generations is set but eval.loss_pass is false"):
        load_config(None, ["eval.num_generations=2"])
    assert load_config(None, ["eval.num_generations=2", "eval.loss_pass=true"]).eval.num_generations == 2
