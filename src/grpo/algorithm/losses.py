"""Losses: the clipped policy surrogate with its KL penalty and aggregation, PPO's clipped value loss and the
PTX next-token loss (the sampler correction's weights on the surrogate: ``grpo.algorithm.sampler_correction``).

``N`` completions of padded length ``L``; masks are ``[N, L]``, 1 for the tokens that carry the loss: the sampled
ones (``Generation.sampled_mask``: a multi-turn row's environment tokens are 0, like padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from grpo.algorithm.clipping import clip_counts
from grpo.algorithm.lookup import lookup


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman).

    Args:
        logprobs, ref_logprobs: same shape (e.g. ``[N, L]``), log-probs of the sampled tokens.

    Returns:
        Same shape, >= 0 everywhere (x - 1 - log x >= 0), exactly 0 where the two agree.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1



# Each aggregation: (per_token [N, L], mask [N, L], normalizer, max_len) -> scalar.
def _agg_grpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    # Mean over each sequence's tokens, then over sequences; an all-masked row counts as 0.
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return per_seq.mean()


def _agg_bnpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _agg_dr_grpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    if max_len is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length (the constant normaliser)")
    return (per_token * mask).sum() / (mask.shape[0] * max_len)


def _agg_dapo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    # Global token count across ranks/micro-batches when the caller passes it; local count otherwise.
    denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return (per_token * mask).sum() / denom


@dataclass(frozen=True)
class LossAggregation:
    """A loss_type: how a micro-batch's per-token loss becomes a scalar (``reduce``), and how micro-batches
    add up to the whole batch's loss under gradient accumulation (``micro_batch_weights``).

    per_row: the loss is a mean over rows (a micro-batch weighs by its rows), not over tokens (by its tokens).
    global_normalizer: ``reduce`` already divides by the whole batch's token count (the ``normalizer``
        over ranks and micro-batches), so a micro-batch's loss is added with weight 1.
    """

    reduce: Callable[..., Tensor]
    per_row: bool
    global_normalizer: bool = False

    def micro_batch_weights(self, rows: int, tokens: Tensor, total_rows: int,
                            total_tokens: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """(the weight of a micro-batch's loss, so that the accumulated gradient equals the batch's; its
        share of the batch, which weighs its statistics). ``tokens``/``total_tokens``: 0-d counts."""
        share = rows / total_rows if self.per_row else tokens / total_tokens.clamp(min=1)
        return (1.0 if self.global_normalizer else share), share

    def rank_scale(self, rows: int, mean_rows: Tensor | float, tokens: Tensor, mean_tokens: Tensor) -> Tensor | float:
        """The factor on one rank's loss when the ranks hold different shares of a step's batch, so that DDP's
        mean of the ranks' gradients is the gradient of the whole batch's loss: each rank's loss is a mean over
        its own rows (grpo, dr_grpo) or tokens (bnpo), which the plain mean over ranks would weigh alike. A
        per-row mean is scaled by the rank's rows over the mean rows per rank, a token mean by its loss tokens
        over the mean tokens per rank (0-d counts; ``mean_tokens`` > 0), a loss already divided by the global
        token count (dapo) by 1. Exactly 1 for a per-row mean when every rank holds as many rows."""
        if self.global_normalizer:
            return 1.0
        return rows / mean_rows if self.per_row else tokens / mean_tokens


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "grpo": LossAggregation(_agg_grpo, per_row=True),
    "bnpo": LossAggregation(_agg_bnpo, per_row=False),
    "dr_grpo": LossAggregation(_agg_dr_grpo, per_row=True),
    "dapo": LossAggregation(_agg_dapo, per_row=False, global_normalizer=True),
}


def loss_aggregation(loss_type: str) -> LossAggregation:
    """``LOSS_AGGREGATIONS[loss_type]``; ValueError listing the known ones."""
    return lookup(LOSS_AGGREGATIONS, "loss_type", loss_type)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    *,
    normalizer: float | Tensor | None = None,
    max_completion_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[N, L]`` with a ``[N, L]`` 0/1 mask to a scalar by ``loss_type``.

    ``grpo``: masked mean per sequence, then mean over sequences; ``bnpo``: masked sum / masked count;
    ``dr_grpo``: masked sum / (N * max_completion_length); ``dapo``: masked sum / ``normalizer``
    (the global token count over ranks and micro-batches), or the local count when it is None.
    """
    return loss_aggregation(loss_type).reduce(per_token, mask.to(per_token.dtype), normalizer, max_completion_length)



# Each level: (log_ratio [N, L], mask [N, L] float) -> [N, L] log importance ratio per token.
def _token_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio  # PPO/GRPO: each token its own ratio


def _sequence_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its tokens' ratios,
    # exp(masked mean of the log-ratios), so the clip judges whole sequences and long ones do not
    # accumulate per-token noise. The gradient flows through the mean to every real token.
    per_sequence = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    return per_sequence.expand_as(log_ratio)


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_level,
    "sequence": _sequence_level,
}


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    normalizer: float | Tensor | None = None,
    importance_sampling_level: str = "token",
    sampler_weights: Tensor | None = None,
    kl_times_ratio: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate with a k3 KL penalty.

    Args:
        logprobs: ``[N, L]`` current policy log-probs of the completion tokens (carries the gradient).
        old_logprobs: ``[N, L]`` log-probs under the policy that sampled (detached here).
        ref_logprobs: ``[N, L]`` reference log-probs, or None only when ``beta == 0``.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens (outcome estimators),
            or ``[N, L]`` one per token (GAE with a critic).
        mask: ``[N, L]`` 1 for sampled completion tokens (up to and including EOS), 0 for padding and for
            tokens an environment inserted; every sum, count and sequence-level ratio runs over it.
        epsilon, epsilon_high: ratio clipped to ``[1 - epsilon, 1 + (epsilon_high or epsilon)]``.
        beta: KL coefficient.
        loss_type: aggregation, see ``aggregate_loss``.
        max_completion_length: the ``dr_grpo`` normaliser.
        normalizer: the ``dapo`` global token count (optional).
        importance_sampling_level: ``"token"``: ratio_t = exp(logp_t - old_t); ``"sequence"`` (GSPO):
            every token of a row gets the row's ratio exp(masked mean of logp - old), clipped and
            multiplied by the advantage as the token ratio is, then aggregated by ``loss_type``.
        sampler_weights: ``[N, L]`` detached per-token weights on the clipped surrogate (the sampler
            correction, ``sampler_importance_weights``), applied before aggregation; the KL term is not
            weighted (as TRL). None = 1.
        kl_times_ratio: the KL term is ratio * k3 (the ratio with its gradient, at the importance-sampling
            level): TRL's ``use_bias_correction_kl``, since the tokens were sampled from pi_old, not pi.

    Returns:
        ``(loss, stats)``: scalar loss = aggregate of -(w * min(ratio*A, clip(ratio)*A) - beta*k3) (w = 1 without
        ``sampler_weights``; k3 times the ratio with ``kl_times_ratio``);
        stats (detached scalars): ``kl`` (masked mean of that KL term, 0 when no reference), ``clip_fraction``
        (share of masked tokens where clipping changed the objective), ``ratio_mean`` (masked mean),
        ``ratio_max``; at the sequence level a row's ratio counts once per real token; TRL's clip counts
        (``clipping.clip_counts``: ``clip_low|high|region|units``, ``clip_low_row_min``, ``clip_high_row_max``).
    """
    _check_policy_inputs(logprobs, old_logprobs, ref_logprobs, advantages, mask, sampler_weights, beta)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    level = lookup(IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level", importance_sampling_level)
    logprobs, old_logprobs, ref_logprobs, adv, mask = _padding_zeroed(logprobs, old_logprobs, ref_logprobs,
                                                                      advantages, mask)
    ratio = torch.exp(level(logprobs - old_logprobs.detach(), mask))  # [N, L]
    unclipped = ratio * adv  # [N, L]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv  # [N, L]
    objective = torch.min(unclipped, clipped)  # [N, L]
    if sampler_weights is not None:
        objective = objective * sampler_weights.detach().to(objective.dtype)
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs.detach())  # [N, L]
        if kl_times_ratio:  # TRL's use_bias_correction_kl: k3 estimates KL under pi_old's samples, not pi's
            kl = kl * ratio
        if beta != 0:
            objective = objective - beta * kl
    else:
        kl = torch.zeros_like(logprobs)
    loss = aggregate_loss(-objective, mask, loss_type, normalizer=normalizer,
                          max_completion_length=max_completion_length)
    return loss, surrogate_stats(ratio, unclipped, clipped, kl, advantages, mask, epsilon, eps_high,
                                 per_sequence=importance_sampling_level == "sequence")


def _check_policy_inputs(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
                         mask: Tensor, sampler_weights: Tensor | None, beta: float) -> None:
    """``policy_loss``'s shape checks: a ValueError naming the argument and the shapes."""
    if beta != 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs may be None only when beta == 0")
    if not (logprobs.shape == old_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [N]={logprobs.shape[0]} or [N, L]={tuple(logprobs.shape)}, got "
                         f"{tuple(advantages.shape)}")
    if sampler_weights is not None and sampler_weights.shape != logprobs.shape:
        raise ValueError(f"sampler_weights must be [N, L]={tuple(logprobs.shape)}, got "
                         f"{tuple(sampler_weights.shape)}")


def _padding_zeroed(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
                    mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """(logprobs, old_logprobs, ref_logprobs [N, L] with 0 on padding; the advantages detached, [N, L] with 0
    on padding or [N, 1]; the mask as a float [N, L]). Padding is masked out of every sum, but inf * 0 is
    NaN: whatever values the passes left at padded positions (another model's, or 0 where a pass skipped
    the column) must not overflow exp()."""
    padding = mask == 0
    logprobs = logprobs.masked_fill(padding, 0.0)
    old_logprobs = old_logprobs.masked_fill(padding, 0.0)
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs.masked_fill(padding, 0.0)
    adv = advantages.detach().to(logprobs.dtype)  # [N] or [N, L]
    adv = adv.masked_fill(padding, 0.0) if adv.dim() == 2 else adv.unsqueeze(1)  # [N, L] or [N, 1]
    return logprobs, old_logprobs, ref_logprobs, adv, mask.to(logprobs.dtype)


@torch.no_grad()
def surrogate_stats(ratio: Tensor, unclipped: Tensor, clipped: Tensor, kl: Tensor, advantages: Tensor,
                    mask: Tensor, epsilon: float, epsilon_high: float, per_sequence: bool) -> dict[str, Tensor]:
    """``policy_loss``'s statistics (detached 0-d tensors, see there) from its ``[N, L]`` ratio, unclipped and
    clipped objectives, KL term and float mask; ``advantages`` [N] or [N, L] as given to it."""
    n_tokens = mask.sum().clamp(min=1)
    was_clipped = (clipped < unclipped).to(mask.dtype)  # min() picked the clipped branch
    stats = {
        "kl": (kl * mask).sum() / n_tokens,
        "clip_fraction": (was_clipped * mask).sum() / n_tokens,
        "ratio_mean": (ratio * mask).sum() / n_tokens,
        # 1 when no token counts; torch.where, not `if mask.any()`, which would wait for the GPU.
        "ratio_max": (torch.where(mask.any(), ratio.masked_fill(mask == 0, float("-inf")).max(), 1.0)
                      if ratio.numel() else ratio.new_ones(())),
    }
    clip = clip_counts(ratio, advantages, mask, epsilon, epsilon_high, per_sequence=per_sequence)
    bound = torch.full((1,), float("inf"), dtype=ratio.dtype, device=ratio.device)  # no host copy: no GPU wait
    stats.update(clip_low=clip.low, clip_high=clip.high, clip_region=clip.region, clip_units=clip.units,
                 clip_low_row_min=torch.cat([clip.row_low.nan_to_num(float("inf")), bound]).min(),
                 clip_high_row_max=torch.cat([clip.row_high.nan_to_num(float("-inf")), -bound]).max())
    return {k: v.detach() for k, v in stats.items()}


def sft_loss(logprobs: Tensor, mask: Tensor) -> Tensor:
    """The supervised next-token loss of PTX: the mean negative log-likelihood of the target tokens.

    Args:
        logprobs: ``[B, L]`` log-probs of each target token given everything before it (``token_logprobs``,
            or ``grpo.step.logprobs.completion_logprobs`` of responses after their prompts).
        mask: ``[B, L]`` 1 for tokens that carry the loss (a response's tokens and its EOS), 0 for the
            prompt and padding.

    Returns:
        Scalar ``-sum(logprobs * mask) / sum(mask)``: a mean over all of the batch's target tokens, not per
        row (a causal LM's loss over its labels, as PaddleNLP's ptx_loss), so a long response weighs by its
        length. 0 when the mask is empty.
    """
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, masked mean.

    Args:
        values: ``[N, L]`` the critic's current values (carries the gradient).
        old_values: ``[N, L]`` the values at sampling time (detached here).
        returns: ``[N, L]`` targets, e.g. from ``gae_advantages`` (detached here).
        mask: ``[N, L]`` 1 for real tokens.
        clip_range: ``c``; the new value may move at most this far from the old one before the
            clipped branch takes over (the max makes the clip pessimistic, never a free pass).

    Returns:
        ``(loss, stats)``: the scalar masked mean (0 with no real token); stats (detached):
        ``value_clip_fraction``, the share of real tokens where the clipped branch was the larger.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"shape mismatch: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
                         f"returns {tuple(returns.shape)}, mask {tuple(mask.shape)}")
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    padding = mask == 0  # as in policy_loss: whatever padding holds must not become inf * 0
    values = values.masked_fill(padding, 0.0)
    old_values = old_values.detach().masked_fill(padding, 0.0)
    returns = returns.detach().masked_fill(padding, 0.0)
    mask = mask.to(values.dtype)
    # clamp(V, lo, hi), not V_old + clamp(V - V_old): inside the range that rounds V by an ulp, and the
    # clipped branch would then count as chosen.
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)  # [N, L]
    unclipped_loss = (values - returns) ** 2  # [N, L]
    clipped_loss = (clipped_values - returns) ** 2  # [N, L]
    per_token = 0.5 * torch.max(unclipped_loss, clipped_loss)  # [N, L]
    n_tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        stats = {"value_clip_fraction": ((clipped_loss > unclipped_loss).to(mask.dtype) * mask).sum() / n_tokens}
    return loss, stats
