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
