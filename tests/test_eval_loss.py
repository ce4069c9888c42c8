"""grpo.training.eval_loss: TRL's evaluation loss, the update's own micro-batch loss without gradients on a
sampled batch, the current weights their own old policy (so nothing is clipped), averaged over batches as
Trainer and TRL's log average them."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from step_helpers import settings_with

from grpo.algorithm import group_advantages
from grpo.models.tiny import build_qwen2
from grpo.rollout.generation import Generation
from grpo.step.experience import generation_logprobs
from grpo.step.records import RolloutBatch
from grpo.training.eval_loss import batch_loss_metrics, mean_of_batches

LENGTHS = [5, 2, 7, 3]  # completion tokens per row; P = 2 prompts, G = 2
REWARDS = [1.0, 0.0, 0.5, 0.5]  # the second group has no spread


def scored_batch(vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    n, lp, lc = len(LENGTHS), 4, max(LENGTHS)
    mask = (torch.arange(lc)[None] < torch.tensor(LENGTHS)[:, None]).long()
    rewards = torch.tensor(REWARDS)
    return RolloutBatch(
        generation=Generation(prompt_ids=torch.randint(3, vocab, (n, lp), generator=gen),
                              prompt_mask=torch.ones(n, lp, dtype=torch.long),
                              completion_ids=torch.randint(3, vocab, (n, lc), generator=gen), completion_mask=mask,
                              truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n),
        rewards=rewards, reward_parts=rewards[:, None], reward_names=["r"],
        advantages=group_advantages(rewards, 2), old_logprobs=None, ref_logprobs=None, prompts=["a", "b"])


def test_the_loss_is_minus_the_advantages_aggregated_and_nothing_is_clipped(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = scored_batch(len(tiny_tokenizer))
    advantages = batch.advantages.tolist()
    for loss_type, expected in (
        # ratio 1: each token's surrogate is -A; dapo/bnpo: a mean over the batch's tokens
        ("dapo", -sum(a * n for a, n in zip(advantages, LENGTHS)) / sum(LENGTHS)),
        ("grpo", -sum(advantages) / len(advantages)),  # a mean over each row's tokens, then over rows
    ):
        metrics = batch_loss_metrics(model, batch, settings_with(loss_type=loss_type, micro_batch_size=3))
        assert math.isclose(metrics["loss"], expected, rel_tol=1e-6, abs_tol=1e-7), (loss_type, metrics["loss"])
        assert all(metrics[k] == 0.0 for k in metrics if k.startswith("clip_ratio/")), metrics
        assert metrics["frac_reward_zero_std"] == 0.5 and metrics["rows"] == 4.0
        assert "kl" not in metrics and metrics["entropy"] > 0
    assert all(p.grad is None for p in model.parameters())  # no gradients


def test_batches_average_as_trainer_and_trl_log_them():
    batches = [{"loss": 1.0, "rows": 8.0, "entropy": 0.5, "clip_ratio/low_min": math.nan},
               {"loss": 4.0, "rows": 4.0, "entropy": 1.5, "clip_ratio/low_min": 0.25}]
    mean = mean_of_batches(batches)
    assert mean["loss"] == (1.0 * 8 + 4.0 * 4) / 12  # Trainer: every row's batch loss, averaged
    assert mean["entropy"] == 1.0 and mean["clip_ratio/low_min"] == 0.25  # TRL's log: NaN-free plain means
    assert "rows" not in mean and mean_of_batches([]) == {}


def test_with_beta_the_kl_to_the_reference_is_logged_and_added(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = scored_batch(len(tiny_tokenizer))
    s = settings_with(loss_type="dapo", micro_batch_size=4, beta=0.5)
    same = replace(batch, ref_logprobs=generation_logprobs(model, batch.generation, s.temperature, 4))
    without = batch_loss_metrics(model, batch, settings_with(loss_type="dapo", micro_batch_size=4))
    metrics = batch_loss_metrics(model, same, s)
    assert abs(metrics["kl"]) < 1e-6 and math.isclose(metrics["loss"], without["loss"], abs_tol=1e-6)
    other = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=1)  # a reference elsewhere: KL > 0
    apart = replace(batch, ref_logprobs=generation_logprobs(other, batch.generation, s.temperature, 4))
    metrics = batch_loss_metrics(model, apart, s)
    assert metrics["kl"] > 0 and metrics["loss"] > without["loss"]
