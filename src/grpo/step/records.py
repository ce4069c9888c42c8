"""Typed records passed between the stages of a step. Shapes and units here; no logic.

Rows are completions; the ``G`` completions of one prompt are contiguous (rows ``i*G .. i*G+G-1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # an annotation only: grpo.rollout's package import loads transformers and peft (the wire's
    from grpo.rollout.generation import Generation  # users, the decoupled launcher among them, need neither)


@dataclass
class RolloutBatch:
    """One step's training data: a ``Generation`` scored and ready for the loss.

    rewards:         [N] float32 total (weighted) reward per completion.
    reward_parts:    [N, F] float32 per reward function (NaN where a function abstained).
    reward_names:    F names, in the column order of ``reward_parts``.
    reward_weights:  F weights of those columns in ``rewards`` (normalize_then_sum's; empty: not known, a batch
                     that came over the decoupled wire, whose advantages the sampler computed).
    advantages:      [N] float32 outcome advantages (one per completion, from its group), or [N, Lc]
                     float32 per-token advantages (gae: PPO with a critic; 0 on padding and, multi-turn, on the
                     environment's tokens, which are not actions: ``grpo.algorithm.ppo``).
    old_logprobs:    [N, Lc] float32 log-probs under the sampling policy, or None when the update takes them
                     from its first iteration (who computes them: ``old_logprobs_after_sampling``).
    ref_logprobs:    [N, Lc] float32 reference log-probs, or None when beta == 0.
    prompts:         P prompt texts (rendered with the chat template), one per group.
    columns:         dataset columns per completion row (e.g. ``answer``), as reward functions get them.
    timings:         seconds spent in each phase that made it (generate_s, rewards_s, logprobs_s).
    reward_metrics:  name -> mean of what the reward functions gave ``log_metric`` for this batch.
    reward_extras:   column -> N values the reward functions gave ``log_extra`` (for samples.jsonl).
    values:          [N, Lc] float32 the critic's values of the state before each completion token at
                     sampling, or None without a critic.
    returns:         [N, Lc] float32 the critic's regression targets (GAE + values) on the sampled tokens
                     (``Generation.sampled_mask``), or None without one.
    sampler_logprobs: [N, Lc] float32 the sampler's own log-prob of each sampled token (0 on padding), when
                     the sampler is not the trainer: vLLM's, or a decoupled sampler's at its (maybe stale)
                     weights. For the off-policy guard and the truncated importance-sampling correction
                     (loss.sampler_is_correction); None when the trainer's own model sampled.
    chat_prompts, chat_completions: N prompts and completions as the reward functions saw them (chat messages,
                     a multi-turn completion's with its tool turns; strings for plain-text prompts), for TRL's
                     ``log_completions``; empty where the batch came without them (a decoupled sampler's).
    """

    generation: Generation
    rewards: Tensor
    reward_parts: Tensor
    reward_names: list[str]
    advantages: Tensor
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    prompts: list[str]
    reward_weights: list[float] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    reward_extras: dict[str, list] = field(default_factory=dict)
    values: Tensor | None = None
    returns: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    chat_prompts: list = field(default_factory=list)
    chat_completions: list = field(default_factory=list)


@dataclass
class SftBatch:
    """One PTX micro-batch of ``B`` prompt/response pairs (``grpo.step.ptx``), laid out as a ``Generation`` is.

    prompt_ids:    [B, Lp] long, the chat-templated prompts, left-padded with the pad id.
    prompt_mask:   [B, Lp] long, 1 for real prompt tokens.
    response_ids:  [B, Lr] long, each response's tokens and the EOS, right-padded with the pad id.
    response_mask: [B, Lr] long, 1 for the tokens that carry the loss (the response and its EOS).
    sources:       B locations ("sft.jsonl:17") of the pairs.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    sources: list[str]


@dataclass
class UpdateStats:
    """One optimizer update of a step (one of its ``num_iterations x mini_batches``), on this rank; ``grpo.step.metrics.
    update_metrics`` reduces it over the ranks. Means are token means over the update's loss tokens.

    loss, kl, ratio_mean: the update's (``kl`` 0 without a reference); entropy: over every sampled token of its
        batch (the step's, or its mini-batch's).
    clip_low, clip_high, clip_region, clip_units: clipped units and their count (``grpo.algorithm.clipping``).
    clip_low_row_min, clip_high_row_max: the least row share of low-clipped tokens and the largest of
        high-clipped ones (NaN: no row had loss tokens).
    policy_loss: the loss without the entropy bonus (``loss`` itself without one); clip_fraction: the token share
        where the objective's clip acted (cispo: its cap, TRL's cispo_clip_ratio); vespo_phi_mean: the mean of VESPO's
        sequence weights (0 for the other loss types).
    grad_norm: before clipping; None when the update was skipped (non-finite).
    learning_rate: the rate the update stepped with; seconds: its wall time (forward, backward, optimizer).
    entropy_coef: the entropy bonus's coefficient (adaptive: its controller's after the update, as TRL logs it; the
        update applied the one before, gated by the entropy target); None: no bonus.
    """

    loss: float
    policy_loss: float
    clip_fraction: float
    vespo_phi_mean: float
    kl: float
    entropy: float
    ratio_mean: float
    clip_low: float
    clip_high: float
    clip_region: float
    clip_units: float
    clip_low_row_min: float
    clip_high_row_max: float
    grad_norm: float | None
    learning_rate: float
    seconds: float
    entropy_coef: float | None = None


@dataclass
class StepUpdate:
    """What ``train_on_batch`` returns: the step's statistics (``totals``: means over its updates, as
    ``metrics.jsonl`` logs a step) and each update's (``updates``, in order)."""

    totals: dict[str, float]
    updates: list[UpdateStats] = field(default_factory=list)
