"""grpo.parallel.optim: the learning-rate schedule and the AdamW it builds (fused on CUDA only); and the torch
learner (grpo.parallel.learners) that steps it."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.parallel.optim import lr_multiplier


def test_lr_schedule_shapes():
    # 10 updates, 2 of warm-up: 0.5, 1.0, then cosine from 1 down towards 0.
    factors = [lr_multiplier(u, 10, 2, "cosine") for u in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0 and all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert math.isclose(lr_multiplier(6, 10, 2, "cosine"), 0.5)  # half-way through the decay
    assert lr_multiplier(6, 10, 2, "linear") == 0.5 and lr_multiplier(9, 10, 2, "constant") == 1.0
    with pytest.raises(ValueError, match="known"):
        lr_multiplier(3, 10, 2, "step")


def test_adamw_is_fused_only_on_cuda():
    # Fused AdamW is a CUDA kernel: a CPU model keeps torch's default (for-each) AdamW.
    from grpo.config.schema import OptimConfig
    from grpo.parallel.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, OptimConfig(), lora=False)
    assert not optimizer.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adamw_is_fused_on_cuda_but_not_for_deepspeed():
    from grpo.config.schema import OptimConfig
    from grpo.parallel.optim import build_optimizer

    model = torch.nn.Linear(4, 4).cuda()
    assert build_optimizer(model, OptimConfig(), lora=False).defaults["fused"] is True
    assert not build_optimizer(model, OptimConfig(), lora=False, allow_fused=False).defaults["fused"]
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    build_optimizer(model, OptimConfig(), lora=False).step()  # the fused kernel accepts these parameters


def test_torch_learner_drops_autocasts_stale_weight_copies_after_each_update():
    # Training runs inside one long bf16 autocast context (fp32 master weights); autocast caches the
    # bf16 copy of each weight and would keep serving it after the optimizer changed the weight.
    from grpo.parallel.learners import TorchLearner

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = TorchLearner(layer, optimizer, scheduler, max_grad_norm=None)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = layer(x)
        learner.backward(before.float().pow(2).sum())
        learner.finish_update()
        after = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = layer(x)  # a new context: no cache
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh)


def _rates(make_scheduler, updates: int, peak: float = 1e-3) -> list[float]:
    """The learning rate of each of ``updates`` optimizer updates under ``make_scheduler(optimizer)``."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind, trl_kind, kwargs", [
    ("linear", "linear", {}),
    ("constant", "constant_with_warmup", {}),
    ("cosine", "cosine", {}),
    ("cosine", "cosine", {"num_cycles": 1.5}),  # down, up, down: the max(0, ...) floor is reached twice
    ("cosine_with_min_lr", "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", "cosine_with_min_lr", {"min_lr": 2e-4, "num_cycles": 0.75}),  # min_lr: a rate, / peak
])
def test_each_decay_with_its_kwargs_gives_transformers_learning_rates(kind, trl_kind, kwargs):
    from transformers import get_scheduler

    from grpo.config.schema import OptimConfig
    from grpo.parallel.optim import build_scheduler

    total, warmup = 12, 3
    cfg = OptimConfig(lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_ratio=warmup / total)
    ours = _rates(lambda o: build_scheduler(o, cfg, total), total)
    theirs = _rates(lambda o: get_scheduler(trl_kind, o, num_warmup_steps=warmup, num_training_steps=total,
                                            scheduler_specific_kwargs=dict(kwargs)), total)
    # after the warm-up the rates are transformers' (to the last bit of a double's rounding)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=1e-18)
    # grpo's warm-up starts at 1/W of the peak where transformers' starts at 0 (docs/guides/python-api.md)
    assert ours[:warmup] == pytest.approx([1e-3 * (u + 1) / warmup for u in range(warmup)], rel=1e-12)
    assert theirs[0] == 0.0
    if kind == "cosine_with_min_lr":  # never below the floor (min_lr 2e-4, or 0.1 x the peak 1e-3)
        floor = kwargs.get("min_lr", 1e-3 * kwargs.get("min_lr_rate", 0.0))
        assert min(ours[warmup:]) >= floor and min(ours[warmup:]) < floor * 1.5


@pytest.mark.parametrize("kind, kwargs, match", [
    ("cosine", {"min_lr": 1e-5}, r"\['min_lr'\] are not arguments of the cosine schedule, which takes num_cycles"),
    ("linear", {"num_cycles": 1}, "which takes no arguments"),
    ("cosine_with_min_lr", {}, "needs exactly one of min_lr or min_lr_rate"),
    ("cosine_with_min_lr", {"min_lr": 1e-6, "min_lr_rate": 0.1}, "needs exactly one of min_lr or min_lr_rate"),
    ("cosine", {"num_cycles": "one"}, "num_cycles must be a number"),
])
def test_kwargs_the_decay_does_not_take_are_refused_naming_the_key(kind, kwargs, match):
    from grpo.config import ConfigError, load_config

    overrides = [f"optim.lr_scheduler_type={kind}", f"optim.lr_scheduler_kwargs={kwargs!r}"]
    with pytest.raises(ConfigError, match=rf"optim.lr_scheduler_kwargs.*{match}"):
        load_config(None, overrides)
    with pytest.raises(ConfigError, match="critic.lr_scheduler_kwargs"):
        load_config(None, [f"critic.lr_scheduler_type={kind}", f"critic.lr_scheduler_kwargs={kwargs!r}",
                           "algorithm.advantage_estimator=gae"])


def test_adam_epsilon_reaches_adamw_and_its_default_is_torchs():
    import inspect

    from grpo.config.schema import OptimConfig
    from grpo.parallel.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    assert OptimConfig().adam_epsilon == inspect.signature(torch.optim.AdamW).parameters["eps"].default
    assert build_optimizer(model, OptimConfig(adam_epsilon=1e-5), lora=False).defaults["eps"] == 1e-5
