"""Losses: the policy loss of every TRL 1.16 loss type (its per-token objective, ``grpo.algorithm.objectives``,
with the KL penalty, reduced by ``grpo.algorithm.aggregation``), PPO's clipped value loss and the PTX next-token
loss (the sampler correction's weights on the surrogate: ``grpo.algorithm.sampler_correction``).

``N`` completions of padded length ``L``; masks are ``[N, L]``, 1 for the tokens that carry the loss: the sampled
ones (``Generation.sampled_mask``: a multi-turn row's environment tokens are 0, like padding).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# The aggregations lived here first; their names are still importable from this module.
from grpo.algorithm.aggregation import (  # noqa: F401
    LOSS_AGGREGATIONS,
    LOSS_TYPES,
    LossAggregation,
    LossType,
    aggregate_loss,
    loss_aggregation,
    loss_type_entry,
)
from grpo.algorithm.clipping import clip_counts
from grpo.algorithm.lookup import lookup
from grpo.algorithm.objectives import POLICY_OBJECTIVES, ObjectiveInputs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman).

    Args:
        logprobs, ref_logprobs: same shape (e.g. ``[N, L]``), log-probs of the sampled tokens.

    Returns:
        Same shape, >= 0 everywhere (x - 1 - log x >= 0), exactly 0 where the two agree.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


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
    delta: float | None = None,
    loss_token_mask: Tensor | None = None,
    sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of a TRL 1.16 ``loss_type`` (default: GRPO's clipped surrogate) with a k3 KL penalty.

    Args:
        logprobs: ``[N, L]`` current policy log-probs of the completion tokens (carries the gradient).
        old_logprobs: ``[N, L]`` log-probs under the policy that sampled (detached here).
        ref_logprobs: ``[N, L]`` reference log-probs, or None only when ``beta == 0``.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens (outcome estimators),
            or ``[N, L]`` one per token (GAE with a critic).
        mask: ``[N, L]`` 1 for sampled completion tokens (up to and including EOS), 0 for padding and for
            tokens an environment inserted; every sum, count and sequence-level ratio runs over it.
        epsilon, epsilon_high: ratio clipped to ``[1 - epsilon, 1 + (epsilon_high or epsilon)]``; for ``cispo``
            ``epsilon_high or epsilon`` is the cap on the ratio itself (``objectives.cispo_objective``).
        beta: KL coefficient. loss_type: a name in ``LOSS_TYPES``, its per-token objective and aggregation.
        max_completion_length: the ``dr_grpo`` normaliser; normalizer: the global token count of ``dapo``,
            ``cispo`` and ``vespo`` (optional).
        importance_sampling_level: ``"token"``: ratio_t = exp(logp_t - old_t); ``"sequence"`` (GSPO): every
            token of a row gets the row's ratio exp(masked mean of logp - old) (``vespo`` weighs whole sequences
            at either level; the level still sets the ratio of ``kl_times_ratio`` and the statistics).
        sampler_weights: ``[N, L]`` detached per-token weights on the surrogate (the sampler correction,
            ``sampler_importance_weights``), applied before aggregation; the KL term is not weighted (as TRL);
            ``vespo`` folds them into its sequence weight instead. None = 1.
        kl_times_ratio: the KL term is ratio * k3 (the ratio with its gradient): TRL's ``use_bias_correction_kl``.
        delta: TRL's two-sided clip of the clipped surrogate (``objectives.clipped_objective``); None: off.
        loss_token_mask: ``[N, L]`` or ``[N, 1]`` 0/1 factors on the surrogate only, not on the KL term nor the
            aggregation's counts (TRL's ``top_entropy_quantile`` and ``off_policy_mask_threshold`` masks:
            ``token_masks.high_entropy_mask`` & ``token_masks.off_policy_mask``). None = 1.
        sapo_*, vespo_*: ``objectives.sapo_objective``, ``objectives.vespo_weights`` (TRL's names, defaults).

    Returns:
        ``(loss, stats)``: scalar loss = aggregate of -(m * w * objective - beta*k3) (m, w = 1 without
        ``loss_token_mask``, ``sampler_weights``; k3 times the ratio with ``kl_times_ratio``); stats (detached
        scalars): ``kl`` (masked mean of that KL term, 0 when no reference), ``clip_fraction`` (share of masked
        tokens where the objective's clip acted: ``Surrogate.cut_off``; 0 for sapo and vespo, which have none),
        ``ratio_mean`` (masked mean), ``ratio_max``; at the sequence level a row's ratio counts once per real
        token; TRL's clip counts of the ratio (``clipping.clip_counts``: ``clip_low|high|region|units``,
        ``clip_low_row_min``, ``clip_high_row_max``); ``vespo`` adds ``vespo_phi_mean``.
    """
    _check_policy_inputs(logprobs, old_logprobs, ref_logprobs, advantages, mask, sampler_weights, beta, loss_token_mask)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    kind = loss_type_entry(loss_type)
    level = lookup(IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level", importance_sampling_level)
    logprobs, old_logprobs, ref_logprobs, adv, mask = _padding_zeroed(logprobs, old_logprobs, ref_logprobs,
                                                                      advantages, mask)
    log_ratio = logprobs - old_logprobs.detach()  # [N, L]
    ratio = torch.exp(level(log_ratio, mask))  # [N, L]
    surrogate = POLICY_OBJECTIVES[kind.objective](ObjectiveInputs(
        logprobs, log_ratio, ratio, adv, mask, None if sampler_weights is None else sampler_weights.detach(), epsilon,
        eps_high, delta, sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
        vespo_lambda_neg))
    objective = surrogate.objective  # [N, L]
    for factor in (loss_token_mask, None if surrogate.sampler_weighted else sampler_weights):
        objective = objective if factor is None else objective * factor.detach().to(objective.dtype)
    kl = _kl_term(logprobs, ref_logprobs, ratio, kl_times_ratio)  # [N, L]
    if ref_logprobs is not None and beta != 0:
        objective = objective - beta * kl
    loss = kind.aggregation.reduce(-objective, mask, normalizer, max_completion_length)
    stats = surrogate_stats(ratio, surrogate.cut_off, kl, advantages, mask, epsilon, eps_high,
                            per_sequence=importance_sampling_level == "sequence")
    return loss, {**stats, **surrogate.stats}


def _kl_term(logprobs: Tensor, ref_logprobs: Tensor | None, ratio: Tensor, kl_times_ratio: bool) -> Tensor:
    """``[N, L]`` the KL term of ``policy_loss`` (zeros without a reference)."""
    if ref_logprobs is None:
        return torch.zeros_like(logprobs)
    kl = kl_k3(logprobs, ref_logprobs.detach())  # [N, L]
    if kl_times_ratio:  # TRL's use_bias_correction_kl: k3 estimates KL under pi_old's samples, not pi's
        kl = kl * ratio
    return kl


def _check_policy_inputs(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
                         mask: Tensor, sampler_weights: Tensor | None, beta: float,
                         loss_token_mask: Tensor | None = None) -> None:
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
    if loss_token_mask is not None and loss_token_mask.shape not in (logprobs.shape, (logprobs.shape[0], 1)):
        raise ValueError(f"loss_token_mask must be [N, L]={tuple(logprobs.shape)} or [N, 1], got "
                         f"{tuple(loss_token_mask.shape)}")


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
def surrogate_stats(ratio: Tensor, cut_off: Tensor, kl: Tensor, advantages: Tensor, mask: Tensor, epsilon: float,
                    epsilon_high: float, per_sequence: bool) -> dict[str, Tensor]:
    """``policy_loss``'s statistics (detached 0-d tensors, see there) from its ``[N, L]`` ratio, where the
    objective's clip acted (bool), KL term and float mask; ``advantages`` [N] or [N, L] as given to it."""
    n_tokens = mask.sum().clamp(min=1)
    was_clipped = cut_off.to(mask.dtype)
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
