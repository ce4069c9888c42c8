"""The critic's half of a PPO step: its own AdamW + schedule (DDP on N ranks), and the clipped value-loss
update over a rollout batch, on the same micro-batches (rows, order) as the policy's update.

The critic shares no parameters with the policy and the advantages are fixed at sampling, so training
it after the policy's pass over the batch gives the same updates as interleaving the two per micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from grpo.algorithm import value_loss
from grpo.config import RunConfig
from grpo.critic.value_model import ValueModel, completion_values, load_value_model
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import Learner, build_learner
from grpo.parallel.optim import build_optimizer, build_scheduler
from grpo.step.micro_batches import rows_by_length
from grpo.step.records import RolloutBatch


@dataclass
class Critic:
    """The value model and what updates it. ``model`` is unwrapped (no-grad value passes, checkpoints);
    ``learner.module`` is what the training forward calls (a DDP wrapper on N ranks)."""

    model: ValueModel
    learner: Learner
    optimizer: torch.optim.Optimizer
    scheduler: object


def build_critic(cfg: RunConfig, info: DistInfo, device: torch.device) -> Critic:
    """Load the critic (``critic.*``) and give it AdamW (``optim``'s betas and optimizer kind, the
    critic's own rate, decay, warm-up, schedule and clipping) over ``max_steps * num_iterations`` updates."""
    c = cfg.critic
    model = load_value_model(c, cfg.model, device)
    optim = dataclasses.replace(cfg.optim, learning_rate=c.learning_rate, lora_learning_rate=None,
                                weight_decay=c.weight_decay, warmup_ratio=c.warmup_ratio,
                                lr_scheduler_type=c.lr_scheduler_type, max_grad_norm=c.max_grad_norm)
    optimizer = build_optimizer(model, optim, lora=False)
    scheduler = build_scheduler(optimizer, optim, cfg.train.max_steps * cfg.loss.num_iterations)
    learner = build_learner(model, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=None,
                            max_grad_norm=c.max_grad_norm)
    return Critic(model, learner, optimizer, scheduler)


@dataclass(frozen=True)
class CriticSettings:
    value_clip: float  # loss.value_clip
    micro_batch_size: int
    num_iterations: int  # updates per rollout batch, as the policy's


def value_fit(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How well the sampling-time values ``[N, L]`` predicted the returns ``[N, L]`` over real tokens:
    their means and the explained variance ``1 - Var(R - V) / Var(R)`` (1: perfect; 0: no better than
    a constant; negative: worse). Var(R) = 0 gives NaN rather than a made-up number."""
    m = mask.bool()
    v, r = values[m].double(), returns[m].double()
    var_r = r.var(unbiased=False) if r.numel() else r.new_tensor(float("nan"))
    explained = 1 - (r - v).var(unbiased=False) / var_r if float(var_r) > 0 else var_r.new_tensor(float("nan"))
    return {"critic/value_mean": float(v.mean()) if v.numel() else float("nan"),
            "critic/return_mean": float(r.mean()) if r.numel() else float("nan"),
            "critic/explained_variance": float(explained)}


def train_critic(learner: Learner, batch: RolloutBatch, s: CriticSettings) -> dict[str, float]:
    """``num_iterations`` critic updates on ``batch`` (which must carry ``values`` and ``returns``).

    Each micro-batch's value loss (a token mean over sampled tokens) is weighted by its share of them,
    so the accumulated gradient is the batch's token mean (averaged over ranks by DDP). Returns this
    rank's ``loss/value``, ``critic/value_clip_fraction``, ``critic/lr``, ``critic/grad_norm``,
    ``critic/skipped_updates`` and ``value_fit``'s metrics.
    """
    if batch.values is None or batch.returns is None:
        raise ValueError("train_critic needs a batch with values and returns (made with a critic: "
                         "algorithm.advantage_estimator gae)")
    gen = batch.generation
    N = gen.completion_ids.shape[0]
    device = next(learner.module.parameters()).device
    # The value loss is over the actions (sampled tokens): environment tokens have no return (grpo.algorithm.ppo).
    mask = gen.sampled_mask.float().to(device)  # [N, Lc]
    old_values, returns = batch.values.to(device), batch.returns.to(device)  # [N, Lc] each
    total_tokens = mask.sum().clamp(min=1)
    starts = list(range(0, N, s.micro_batch_size))
    P = len(batch.prompts)
    order = (rows_by_length(gen.completion_mask, N // P) if len(starts) > 1 and P and N % P == 0
             else torch.arange(N))  # [N]: the policy update's order (grpo.step.policy_update.train_on_batch)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss, value_clip_fraction]
    learning_rate = learner.lr
    grad_norms, skipped = [], 0
    for _ in range(s.num_iterations):
        for index, start in enumerate(starts):
            rows = order[start:start + s.micro_batch_size]
            on_device = rows.to(device)
            with learner.accumulating(last=index == len(starts) - 1):
                values = completion_values(learner.module, gen.prompt_ids[rows], gen.prompt_mask[rows],
                                           gen.completion_ids[rows], gen.completion_mask[rows])  # [b, Lc]
                rows_mask = mask[on_device]
                loss, stats = value_loss(values, old_values[on_device], returns[on_device], rows_mask, s.value_clip)
                share = rows_mask.sum() / total_tokens
                learner.backward(loss * share)
            with torch.no_grad():
                sums += torch.stack([loss.detach() * share, stats["value_clip_fraction"] * share]).double() \
                    / s.num_iterations
        norm = learner.finish_update().grad_norm
        if norm is None:
            skipped += 1
        else:
            grad_norms.append(norm)
    loss_sum, clip_sum = sums.tolist()
    return {"loss/value": loss_sum, "critic/value_clip_fraction": clip_sum, "critic/lr": learning_rate,
            "critic/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "critic/skipped_updates": float(skipped), **value_fit(batch.values, batch.returns, gen.sampled_mask)}
