"""``grpo train`` with the strategies of transformers' Trainer: checkpoints, evaluations and samples at TRL's epoch
ends (train.save_strategy / train.eval_strategy / log.logging_strategy: epoch), none under save_strategy no, and
train.load_best_at_end ending the run with best/'s weights."""

from __future__ import annotations

import json

import pytest
import torch
from run_helpers import base_overrides, read_metrics
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.training.colocated import train

pytestmark = pytest.mark.integration


def weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


def test_epoch_strategies_and_load_best_at_end(tiny_model_dir, tmp_path):
    # 7 prompts, 2 per step: an epoch is 3 steps (TRL's count leaves the 7th out); 5 steps end inside the second
    out = tmp_path / "run"
    cfg = load_config(None, base_overrides(tiny_model_dir, out, **{
        "data.train": "synthetic:seed=1,n=7", "data.eval": "synthetic:seed=9,n=4", "train.max_steps": 5,
        "train.save_strategy": "epoch", "train.eval_strategy": "epoch", "log.logging_strategy": "epoch",
        "log.num_samples": 1, "train.save_total_limit": None, "train.best_metric": "eval/accuracy",
        "train.load_best_at_end": True, "rewards": "[{name: 'rewards_for_tests:letters'}]"}))
    train(cfg)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-3", "step-5"]  # and the end
    evaluated = [r["step"] for r in read_metrics(out) if "eval/accuracy" in r]
    assert evaluated == [0, 3, 5]  # before training, the epoch's end, after the last step (train.eval_at_end)
    samples = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [3, 5]
    # the random model answers nothing right: every accuracy ties at 0 and best/ keeps the first, the initial model
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 0
    initial, final = weights(tiny_model_dir), weights(out / "final")
    assert all(torch.equal(initial[k], final[k]) for k in final)  # the run ends with best/'s weights
    last = weights(out / "checkpoints" / "step-5")
    assert any(not torch.equal(last[k], final[k]) for k in final)  # which are not the last step's


def test_save_strategy_no_writes_no_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(load_config(None, base_overrides(tiny_model_dir, out, **{"train.save_strategy": "no"})))
    assert not (out / "checkpoints").exists() and (out / "final" / "model.safetensors").is_file()
