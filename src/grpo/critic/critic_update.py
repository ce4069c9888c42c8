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
from grpo.config.rules import updates_per_step
from grpo.critic.value_model import ValueModel, completion_values, load_value_model
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import Learner, build_learner
from grpo.parallel.optim import build_optimizer, build_scheduler
from grpo.step.batching import mini_batches
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
    critic's own rate, decay, warm-up, schedule and clipping) over the run's updates (the policy's count)."""
    c = cfg.critic
    model = load_value_model(c, cfg.model, device)
    optim = dataclasses.replace(cfg.optim, learning_rate=c.learning_rate, lora_learning_rate=None,
                                weight_decay=c.weight_decay, warmup_ratio=c.warmup_ratio,
                                lr_scheduler_type=c.lr_scheduler_type,
                                lr_scheduler_kwargs=c.lr_scheduler_kwargs, max_grad_norm=c.max_grad_norm)
    optimizer = build_optimizer(model, optim, lora=False)
    scheduler = build_scheduler(optimizer, optim, cfg.train.max_steps * updates_per_step(cfg))
    learner = build_learner(model, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=None,
                            max_grad_norm=c.max_grad_norm)
    return Critic(model, learner, optimizer, scheduler)


@dataclass(frozen=True)
class CriticSettings:
    value_clip: float  # loss.value_clip
    micro_batch_size: int
    num_iterations: int  # passes over the rollout batch, as the policy's
    mini_batches: int = 1  # updates per pass (train.mini_batches), on the policy's mini-batches


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
    """``num_iterations x mini_batches`` critic updates on ``batch`` (which must carry ``values`` and ``returns``):
    each pass one update per mini-batch, the policy's mini-batches (``grpo.step.batching.mini_batches``).

    Each micro-batch's value loss (a token mean over sampled tokens) is weighted by its share of its
    mini-batch's, so the accumulated gradient is the mini-batch's token mean (averaged over ranks by DDP).
    Returns this rank's ``loss/value`` and ``critic/value_clip_fraction`` (means over the updates),
    ``critic/lr`` (the first update's), ``critic/grad_norm``, ``critic/skipped_updates`` and ``value_fit``'s
    metrics.
    """
    if batch.values is None or batch.returns is None:
        raise ValueError("train_critic needs a batch with values and returns (made with a critic: "
                         "algorithm.advantage_estimator gae)")
    device = next(learner.module.parameters()).device
    parts = mini_batches(batch, s.mini_batches)
    updates = s.num_iterations * len(parts)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss, value_clip_fraction], means over updates
    learning_rate = learner.lr
    grad_norms, skipped = [], 0
    for _ in range(s.num_iterations):
        for part in parts:
            critic_backward(learner, part, s, sums, updates)
            norm = learner.finish_update().grad_norm
            if norm is None:
                skipped += 1
            else:
                grad_norms.append(norm)
    loss_sum, clip_sum = sums.tolist()
    gen = batch.generation
    return {"loss/value": loss_sum, "critic/value_clip_fraction": clip_sum, "critic/lr": learning_rate,
            "critic/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "critic/skipped_updates": float(skipped), **value_fit(batch.values, batch.returns, gen.sampled_mask)}


def critic_backward(learner: Learner, batch: RolloutBatch, s: CriticSettings, sums: torch.Tensor,
                    updates: int) -> None:
    """One critic update's backward passes over ``batch`` (its mini-batch), on the policy update's micro-batches
    (rows, order). Adds to ``sums`` ([2] float64, on the critic's device) its value loss and clipped share (token
    means over its sampled tokens) / ``updates``, the step's count: its share of their means."""
    device = sums.device
    gen = batch.generation
    N = gen.completion_ids.shape[0]
    # The value loss is over the actions (sampled tokens): environment tokens have no return (grpo.algorithm.ppo).
    mask = gen.sampled_mask.float().to(device)  # [N, Lc]
    old_values, returns = batch.values.to(device), batch.returns.to(device)  # [N, Lc] each
    total_tokens = mask.sum().clamp(min=1)
    starts = list(range(0, N, s.micro_batch_size))
    P = len(batch.prompts)
    order = (rows_by_length(gen.completion_mask, N // P) if len(starts) > 1 and P and N % P == 0
             else torch.arange(N))  # [N]: the policy update's order (grpo.step.update_inputs.prepare_batch)
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
            sums += torch.stack([loss.detach() * share, stats["value_clip_fraction"] * share]).double() / updates
