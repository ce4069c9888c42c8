"""What a step reports about its rollouts: reward, accuracy, lengths, signal; and sample records."""

from __future__ import annotations

import math

import torch

from grpo.records import RolloutBatch


def rollout_metrics(batch: RolloutBatch, correct: torch.Tensor, formatted: torch.Tensor,
                    group_size: int) -> dict[str, float]:
    """This rank's rollout metrics (means over its completions; rank-averaging is the caller's).

    ``reward/mean_sq`` is carried so the caller can form the std over all ranks.
    """
    rewards = batch.rewards.double()
    lengths = batch.generation.completion_mask.sum(dim=1).double()  # [N]
    grouped = rewards.view(-1, group_size)  # [P, G]
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/mean_sq": (rewards ** 2).mean().item(),
        "accuracy": correct.double().mean().item(),
        "format_rate": formatted.double().mean().item(),
        "completion_length/mean": lengths.mean().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": batch.generation.truncated.double().mean().item(),
        "zero_std_fraction": (grouped == grouped[:, :1]).all(dim=1).double().mean().item(),
        "advantage/abs_mean": batch.advantages.abs().double().mean().item(),
    }
    for f, name in enumerate(batch.reward_names):
        column = batch.reward_parts[:, f]
        valid = column[~torch.isnan(column)]
        metrics[f"reward/{name}"] = valid.double().mean().item() if valid.numel() else math.nan
    return metrics


def sample_records(batch: RolloutBatch, examples, num_samples: int, tag_style: str) -> list[dict]:
    """The first ``num_samples`` completions with their prompt, gold answer and rewards."""
    G = batch.generation.completion_ids.shape[0] // len(examples)
    records = []
    for row in range(min(num_samples, len(batch.generation.completions))):
        example = examples[row // G]
        records.append({
            "source": example.source,
            "prompt": example.question,
            "completion": batch.generation.completions[row],
            "answer": example.answer,
            "reward": float(batch.rewards[row]),
            "rewards": {name: _finite_or_none(batch.reward_parts[row, f])
                        for f, name in enumerate(batch.reward_names)},
            "advantage": float(batch.advantages[row]),
            "truncated": bool(batch.generation.truncated[row]),
        })
    return records


def _finite_or_none(value: torch.Tensor) -> float | None:
    v = float(value)
    return v if math.isfinite(v) else None
