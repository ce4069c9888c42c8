"""model.fp16: float16 mixed precision with dynamic loss scaling, run for real on the CPU (torch's CPU autocast and
GradScaler): an overflow skips the update and halves the scale without tripping the run's guard, a non-finite loss
still does, the scaler's state travels in checkpoints and comes back on resume, and a run trains."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import ConfigError, load_config
from grpo.errors import TrainingAborted
from grpo.models.loading import compute_context, policy_dtype
from grpo.models.precision import uses_autocast
from grpo.models.tiny import build_qwen2
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import DeepSpeedLearner, TorchLearner, UpdateOutcome, deepspeed_config
from grpo.parallel.trainable import build_trainable
from grpo.run.checkpoint import SCALER_FILE, CheckpointError, load_checkpoint, save_checkpoint
from grpo.run.tracking import read_metrics
from grpo.step.policy_update import train_on_batch
from grpo.training.colocated import train
from grpo.training.guards import SkipGuard
from grpo.training.resume import resume_checkpoint, save_run_checkpoint
from step_helpers import random_batch, settings_with

FP16 = torch.float16


def learner_of(module, init_scale=2.0 ** 16):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    return TorchLearner(module, optimizer, scheduler, None, torch.amp.GradScaler("cpu", init_scale=init_scale))


def fp16_update(learner, layer, loss_factor=1.0) -> UpdateOutcome:
    """One update of ``layer`` on a float16 forward: d loss / d output = scale x ``loss_factor`` in float16."""
    with torch.autocast("cpu", dtype=FP16):
        out = layer(torch.ones(1, 4))  # [1, 4] float16
    assert out.dtype == FP16
    learner.backward(out.float().sum() * loss_factor)
    return learner.finish_update()


def test_an_overflow_skips_the_update_halves_the_scale_and_the_next_update_applies():
    layer = torch.nn.Linear(4, 4)
    learner = learner_of(layer)
    before = layer.weight.detach().clone()
    # 2^16 x 1 is past float16's largest value (65504): the output's gradient is inf, so are the weights'
    skipped = fp16_update(learner, layer)
    assert skipped == UpdateOutcome(None, overflow=True, loss_scale=2.0 ** 15)
    assert torch.equal(layer.weight, before) and layer.weight.grad is None  # not applied, gradients dropped
    applied = fp16_update(learner, layer)  # 2^15 fits: applied, unscaled (the norm of the true gradients)
    assert applied.overflow is False and applied.loss_scale == 2.0 ** 15
    # d/dW and d/db of sum(W x + b) for x of ones are 1 everywhere: 16 + 4 ones, a norm of sqrt(20)
    assert applied.grad_norm == pytest.approx(math.sqrt(20.0))
    assert not torch.equal(layer.weight, before)


def test_a_non_finite_loss_or_an_overflow_at_scale_1_is_not_an_overflow_skip():
    layer = torch.nn.Linear(4, 4)
    assert fp16_update(learner_of(layer, init_scale=2.0 ** 8), layer, float("nan")).overflow is False
    # at scale 1 the gradient (1e5) overflows float16 unscaled: a non-finite update, not the scaler's warm-up
    outcome = fp16_update(learner_of(layer, init_scale=1.0), layer, 1e5)
    assert outcome.grad_norm is None and outcome.overflow is False and outcome.loss_scale == 0.5


def test_overflow_skips_are_logged_and_not_counted_by_the_skip_guard(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    learner = learner_of(model, init_scale=2.0 ** 40)  # far past float16: the first update overflows
    with torch.autocast("cpu", dtype=FP16):
        stats = train_on_batch(learner, random_batch(len(tiny_tokenizer)), settings_with(), DistInfo()).totals
        second = train_on_batch(learner, random_batch(len(tiny_tokenizer), seed=1), settings_with(), DistInfo()).totals
    assert (stats["skipped_updates"], stats["fp16/overflow_updates"], stats["fp16/loss_scale"]) == (1.0, 1.0, 2.0 ** 39)
    assert math.isnan(stats["grad_norm"])
    guard = SkipGuard(max_consecutive=1, updates_per_step=1)
    guard.record(1, stats)  # an overflow skip: the scaler at work, no abort
    assert guard.consecutive == 0
    assert second["fp16/loss_scale"] <= 2.0 ** 39  # halved again while it overflows
    with pytest.raises(TrainingAborted, match="non-finite"):  # a non-finite skip still counts
        guard.record(2, {**stats, "fp16/overflow_updates": 0.0})


def test_the_scaler_state_round_trips_through_a_checkpoint(tiny_tokenizer, tmp_path):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    scaler = torch.amp.GradScaler("cpu")
    state = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
             "_growth_tracker": 7}
    scaler.load_state_dict(state)
    folder = save_checkpoint(tmp_path, 3, model, None, None, None, {}, None, scaler=scaler)
    assert (folder / SCALER_FILE).is_file()
    restored = torch.amp.GradScaler("cpu")
    load_checkpoint(folder, model, scaler=restored)
    assert restored.state_dict() == state
    without = save_checkpoint(tmp_path / "bf16-run", 3, model, None, None, None, {}, None)
    with pytest.raises(CheckpointError, match="scaler.pt is missing: the checkpoint was saved without model.fp16"):
        load_checkpoint(without, model, scaler=torch.amp.GradScaler("cpu"))


def tiny_run(model_dir, out, **extra) -> list[str]:
    values = {"model.name_or_path": model_dir, "model.fp16": True, "data.train": "synthetic:seed=1,n=64",
              "rollout.num_generations": 4, "rollout.max_completion_length": 12, "train.prompts_per_step": 2,
              "train.micro_batch_size": 4, "train.max_steps": 3, "train.save_steps": 1, "train.output_dir": out,
              "train.seed": 0, "optim.learning_rate": 1e-3, "loss.beta": 0.04, "log.report_to": "[]",
              "log.progress_bar": False, "log.plots": False,
              "rewards": "[{name: answer_correct}, {name: format_think_answer}]", **extra}
    return [f"{key}={value}" for key, value in values.items()]


def test_resume_restores_the_loss_scaler(tiny_model_dir, tiny_tokenizer, tmp_path):
    cfg = load_config(None, tiny_run(tiny_model_dir, tmp_path / "run"))
    saved = build_trainable(cfg, build_qwen2(tiny_tokenizer, hidden_size=64, num_layers=2, seed=0), DistInfo())
    saved.scaler.load_state_dict({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                  "growth_interval": 2000, "_growth_tracker": 3})
    save_run_checkpoint(tmp_path / "run", 2, saved, None, {"step": 2}, None, DistInfo())
    fresh = build_trainable(cfg, build_qwen2(tiny_tokenizer, hidden_size=64, num_layers=2, seed=1), DistInfo())
    assert fresh.scaler.get_scale() == 2.0 ** 16
    checkpoint, state = resume_checkpoint(tmp_path / "run", fresh, DistInfo())
    assert state["step"] == 2 and fresh.scaler.state_dict() == saved.scaler.state_dict()
    assert fresh.learner.scaler is fresh.scaler  # the learner scales with the restored scaler


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4])
def test_an_fp16_run_trains_on_the_cpu_with_fp32_weights(tiny_model_dir, tmp_path, lora):
    out = tmp_path / "run"
    train(load_config(None, tiny_run(tiny_model_dir, out, **{"model.lora_r": lora})))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss", "kl", "grad_norm", "entropy", "fp16/loss_scale")), row
        assert row["fp16/loss_scale"] == 2.0 ** 16 and row["skipped_updates"] == row["fp16/overflow_updates"]
    assert all(row["skipped_updates"] == 0.0 for row in rows[1:])  # past its warm-up, updates apply
    final = load_file(out / "final" / ("adapter_model.safetensors" if lora else "model.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.float32}  # the weights train in fp32, compute in float16
    for step in (2, 3):  # the two newest (train.save_total_limit)
        assert torch.load(out / "checkpoints" / f"step-{step}" / SCALER_FILE, weights_only=True)["scale"] == 2.0 ** 16


def test_fp16_computes_under_float16_autocast_over_fp32_weights_lora_included():
    for lora in (0, 8):
        cfg = load_config(None, ["model.fp16=true", f"model.lora_r={lora}"]).model
        assert uses_autocast(cfg, deepspeed=False) and not uses_autocast(cfg, deepspeed=True)
        with compute_context(cfg, torch.device("cpu"), False):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == FP16
    assert policy_dtype(load_config(None, ["model.fp16=true"]).model) == FP16  # the frozen reference, DeepSpeed
    bf16_lora = load_config(None, ["model.bf16=true", "model.lora_r=8"]).model
    assert not uses_autocast(bf16_lora, deepspeed=False)  # bf16 LoRA: fp32 adapters over a bf16 base, as before


@pytest.mark.parametrize("overrides, why", [
    (["model.fp16=true", "model.bf16=true"], "model.fp16 cannot be combined with model.bf16"),
    (["model.fp16=true", "model.load_in_4bit=true", "model.lora_r=8"], "model.fp16 cannot be combined with "
                                                                        "model.load_in_4bit"),
    (["model.fp16=true", "algorithm.advantage_estimator=gae", "rollout.num_generations=1", "loss.scale_rewards=null"],
     "model.fp16 cannot be combined with algorithm.advantage_estimator gae"),
    (["model.fp16=true", "train.mode=decoupled"], "model.fp16 cannot be combined with train.mode decoupled"),
])
def test_what_fp16_cannot_be_combined_with_is_refused_with_its_reason(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, overrides)


def test_deepspeed_gets_its_fp16_section_from_model_fp16(tmp_path):
    path = tmp_path / "ds.json"
    sizes = dict(micro_batch_size=2, accumulation_steps=1, world_size=1, max_grad_norm=1.0, bf16=False)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert deepspeed_config(str(path), **sizes, fp16=True)["fp16"] == {"enabled": True}  # DeepSpeed's own scaling
    assert deepspeed_config(str(path), **sizes)["fp16"] == {"enabled": False}
    path.write_text(json.dumps({"fp16": {"enabled": "auto", "initial_scale_power": 12}}))
    assert deepspeed_config(str(path), **sizes, fp16=True)["fp16"] == {"enabled": True, "initial_scale_power": 12}
    path.write_text(json.dumps({"fp16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="fp16.enabled is True but model.fp16 is False"):
        deepspeed_config(str(path), **sizes)


class StubEngine:
    """What DeepSpeedLearner reads of an engine after the update's last micro-batch."""

    def __init__(self, applied: bool):
        self.applied, self.optimizer = applied, SimpleNamespace(loss_scale=4096.0)

    def was_step_applied(self) -> bool:
        return self.applied

    def get_global_grad_norm(self) -> float:
        return 0.5


def test_a_deepspeed_fp16_skip_is_an_overflow_with_its_scale():
    assert DeepSpeedLearner(StubEngine(False), fp16=True).finish_update() == UpdateOutcome(None, True, 4096.0)
    assert DeepSpeedLearner(StubEngine(True), fp16=True).finish_update() == UpdateOutcome(0.5, False, 4096.0)
    assert DeepSpeedLearner(StubEngine(False)).finish_update() == UpdateOutcome(0.5)  # no fp16: as before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_updates_on_cuda(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    learner = TorchLearner(model, optimizer, scheduler, 1.0, torch.amp.GradScaler("cuda"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cuda", dtype=FP16):
        for seed in range(4):  # past any overflow of the scaler's warm-up
            stats = train_on_batch(learner, random_batch(len(tiny_tokenizer), seed=seed), settings_with(),
                                   DistInfo()).totals
    assert stats["skipped_updates"] == 0.0 and math.isfinite(stats["grad_norm"]) and stats["fp16/loss_scale"] > 1
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_static_engine_samples_in_float16_on_cuda_and_in_the_policys_dtype_elsewhere(tiny_tokenizer, device):
    from grpo.rollout.build import build_engine

    cfg = load_config(None, ["model.fp16=true", "rollout.engine=hf-static"])
    engine = build_engine(cfg, build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).to(device),
                          tiny_tokenizer)
    assert engine.copy.dtype == (FP16 if device == "cuda" else torch.float32)  # not CUDA's bf16 default
