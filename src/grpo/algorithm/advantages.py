"""Advantages: how much better than expected each completion (or token) did.

Outcome estimators (``group_advantages``) give one advantage per completion from the rewards of its
group; ``gae_advantages`` gives one per token from per-token rewards and a critic's values. Rows
``i*G .. i*G+G-1`` are the completions of prompt ``i``; ``N = P*G``; ``L`` the padded completion length.
Masks are ``[N, L]``, 1 for real completion tokens (a prefix of each row: right padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from grpo.algorithm.lookup import lookup


def _scale_group(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # Bessel-corrected std per group, as TRL; a group of one has no spread (std := 0).
    G = grouped.shape[1]
    std = grouped.std(dim=1, keepdim=True) if G > 1 else torch.zeros_like(grouped[:, :1])
    return centred / (std + eps)


def _scale_batch(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # TRL's scale_rewards="batch": the std of the raw rewards over the batch (between-group spread included).
    std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
    return centred / (std + eps)


def _scale_none(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred  # Dr. GRPO: no division, so easy/hard groups are not up-weighted


ADVANTAGE_SCALES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "group": _scale_group,
    "batch": _scale_batch,
    "none": _scale_none,
}


def _centred(grouped: Tensor) -> Tensor:
    """[P, G] rewards minus their group mean; exact zeros for a group whose rewards are all equal (the
    mean of equal floats can differ from them by one ulp, which scaling would blow up)."""
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    return torch.where(constant, torch.zeros_like(centred), centred)


def _fixed_scale(estimator: str, scale: str | None) -> None:
    if scale is not None:
        raise ValueError(f"advantage estimator {estimator!r} has its own scaling; scale {scale!r} applies to the "
                         "'grpo' estimator only (pass scale=None)")


# Each estimator: (grouped [P, G] rewards, scale name or None, eps) -> [P, G] advantages.
def _grpo(grouped: Tensor, scale: str | None, eps: float) -> Tensor:
    scale_fn = lookup(ADVANTAGE_SCALES, "advantage scale", "group" if scale is None else scale)
    return scale_fn(_centred(grouped), grouped, eps)


def _rloo(grouped: Tensor, scale: str | None, eps: float) -> Tensor:
    # r_i - mean of the other G-1 = r_i - (S - r_i)/(G-1) = G/(G-1) * (r_i - mean): the baseline leaves
    # out the completion it judges, so it is unbiased; no std division (that would re-weight prompts).
    _fixed_scale("rloo", scale)
    G = grouped.shape[1]
    if G == 1:  # no other completion to compare with: no signal
        return torch.zeros_like(grouped)
    return _centred(grouped) * (G / (G - 1))


def _reinforce_pp(grouped: Tensor, scale: str | None, eps: float) -> Tensor:
    # REINFORCE++-baseline (OpenRLHF, verl): centre per group, then divide by the std over the whole batch
    # of the *centred* rewards (within-group spread only; scale "batch" of grpo uses the raw rewards').
    _fixed_scale("reinforce_pp", scale)
    centred = _centred(grouped)
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return centred / (std + eps)


@dataclass(frozen=True)
class AdvantageEstimator:
    """An estimator and what a run needs for it.

    from_group: (grouped [P, G] rewards, scale name or None, eps) -> [P, G] advantages; None for an
        estimator that does not work from group rewards (``gae``: ``grpo.algorithm.ppo.ppo_advantages``).
    needs_critic: a value model is trained beside the policy (``grpo.critic``).
    token_level: advantages are ``[N, L]`` per token, not ``[N]`` per completion.
    takes_scale: its scaling is chosen (``ADVANTAGE_SCALES``, ``loss.scale_rewards``); the others' is part of
        their definition.
    """

    from_group: Callable[[Tensor, str | None, float], Tensor] | None
    needs_critic: bool = False
    token_level: bool = False
    takes_scale: bool = False

    @property
    def group_baseline(self) -> bool:
        """The group is the baseline: G >= 2 is needed, and an all-equal group carries no signal."""
        return self.from_group is not None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo, takes_scale=True),
    "rloo": AdvantageEstimator(_rloo),
    "reinforce_pp": AdvantageEstimator(_reinforce_pp),
    "gae": AdvantageEstimator(None, needs_critic=True, token_level=True),  # PPO
}


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator called ``name``; ValueError listing the known ones."""
    return lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def group_advantages(rewards: Tensor, group_size: int, scale: str | None = None, eps: float = 1e-4,
                     estimator: str = "grpo") -> Tensor:
    """Outcome advantages, one per completion, from the rewards of its group.

    Args:
        rewards: ``[N]`` total reward per completion, ``N = P * group_size``, groups contiguous.
        group_size: ``G``, completions per prompt.
        scale: the ``grpo`` estimator's division (None means ``"group"``): ``"group"``: (r - group mean) /
            (group std + eps), std with Bessel's correction; ``"batch"``: centred per group, divided by
            the std of all the batch's rewards + eps; ``"none"``: centred only (Dr. GRPO). Must be None
            for the other estimators, whose scaling is part of their definition.
        eps: added to a std so that a near-constant group or batch does not explode.
        estimator: ``"grpo"``; ``"rloo"``: r_i minus the mean of the group's other G-1 rewards (0 for
            G = 1); ``"reinforce_pp"``: r - group mean, divided by the batch std of those centred values
            (Bessel) + eps.

    Returns:
        ``[N]`` advantages (float32 or the rewards' float dtype). A group whose rewards are all equal
        gets exactly 0 under every estimator, also for ``G = 1``.

    Raises:
        ValueError: ``N`` is not a multiple of ``G``, a reward is NaN, the estimator or scale is
            unknown or not a group estimator, or a scale is given to an estimator other than ``grpo``.
    """
    estimate = advantage_estimator(estimator).from_group
    if estimate is None:
        raise ValueError(f"advantage estimator {estimator!r} works per token from a critic's values "
                         "(grpo.algorithm.ppo.ppo_advantages), not from group rewards")
    if scale is not None:
        lookup(ADVANTAGE_SCALES, "advantage scale", scale)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards {rewards.numel()} is not a multiple of group_size {group_size}")
    if torch.isnan(rewards).any():
        raise ValueError(f"rewards contain NaN at rows {torch.nonzero(torch.isnan(rewards)).flatten().tolist()}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)  # [P, G]
    return estimate(grouped, scale, eps).reshape(-1)  # [N]


def _check_prefix_mask(mask: Tensor, *shapes: Tensor) -> None:
    if any(t.shape != mask.shape for t in shapes) or mask.dim() != 2:
        raise ValueError(f"expected [N, L] tensors shaped like the mask {tuple(mask.shape)}, got "
                         f"{[tuple(t.shape) for t in shapes]}")
    if (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError("mask must be 1 on a prefix of each row (right padding): a gap would end an episode early")


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each completion's tokens.

    Args:
        token_rewards: ``[N, L]`` reward at each token (e.g. ``kl_penalized_token_rewards``).
        values: ``[N, L]`` the critic's value of the state before each token.
        mask: ``[N, L]`` 1 on each row's real tokens (a prefix of the row).
        gamma: discount per token; lam: GAE's bias/variance trade-off (1: Monte-Carlo, 0: one-step TD).

    Returns:
        ``(advantages, returns)``, both ``[N, L]``: ``delta_t = r_t + gamma * V_{t+1} - V_t``,
        ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``. The episode ends at a row's last
        real token (``V_{t+1} = 0`` and ``A_{t+1} = 0`` there); padding gets 0 in both. Not whitened
        (see ``whiten``). Same dtype as the inputs, no gradient.
    """
    _check_prefix_mask(mask, token_rewards, values)
    with torch.no_grad():
        m = mask.to(values.dtype)
        rewards, values = token_rewards.to(values.dtype) * m, values * m  # padding never leaks in
        advantages = torch.zeros_like(values)  # [N, L]
        next_value = values.new_zeros(values.shape[0])  # [N]: V_{t+1}, 0 past a row's end
        next_advantage = values.new_zeros(values.shape[0])  # [N]: A_{t+1}
        for t in reversed(range(values.shape[1])):  # a recurrence: one step per column, vectorised over rows
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantages[:, t] = (delta + gamma * lam * next_advantage) * m[:, t]
            next_value, next_advantage = values[:, t], advantages[:, t]
        return advantages, (advantages + values) * m


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``x`` shifted and scaled to masked mean 0 and std 1: ``(x - mean) / sqrt(var + eps)``.

    Args:
        x, mask: same shape; only entries where ``mask`` is 1 are counted.
        eps: keeps a constant ``x`` finite (it then whitens to 0).

    Returns:
        Same shape; masked-out entries are 0. The variance has Bessel's correction (as verl's
        ``masked_whiten``); fewer than two counted entries have variance 0.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} differ")
    m = mask.to(x.dtype)
    count = m.sum()
    mean = (x * m).sum() / count.clamp(min=1)
    centred = (x - mean) * m
    var = (centred ** 2).sum() / (count - 1).clamp(min=1)
    return centred * torch.rsqrt(var + eps)


def kl_penalized_token_rewards(sequence_rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """PPO's per-token reward with the KL penalty in the reward instead of the loss.

    Args:
        sequence_rewards: ``[N]`` reward of each completion.
        kl: ``[N, L]`` per-token KL estimate against the reference (e.g. ``kl_k3`` or logp - ref_logp).
        mask: ``[N, L]`` 1 on each row's real tokens (a prefix; at least one per row).
        kl_coef: the penalty's weight.

    Returns:
        ``[N, L]``: ``r_t = -kl_coef * KL_t`` on real tokens, plus the sequence reward at each row's last
        real token (where the episode's outcome is known); 0 on padding. No gradient.
    """
    _check_prefix_mask(mask, kl)
    if sequence_rewards.shape != mask.shape[:1]:
        raise ValueError(f"sequence_rewards must be [N]={mask.shape[0]}, got {tuple(sequence_rewards.shape)}")
    lengths = mask.sum(-1).long()  # [N]
    if (lengths == 0).any():
        raise ValueError("a row has no real token: its sequence reward would be placed nowhere")
    with torch.no_grad():
        rewards = -kl_coef * kl.masked_fill(mask == 0, 0.0)  # [N, L]; whatever padding held (inf) is gone
        last = (lengths - 1)[:, None]  # [N, 1]
        return rewards.scatter_add(1, last, sequence_rewards.to(kl.dtype)[:, None])


# Several reward functions: TRL 1.16's multi_objective_aggregation. A NaN reward is a function that did not score
# the completion (a reward function's None in TRL): it is left out of every sum, mean and spread; a completion no
# function scored is left out of its group's statistics and gets advantage 0.
def _nan_centred(x: Tensor, dim: int | None) -> Tensor:
    """``x`` minus its NaN-ignoring mean over ``dim`` (None: all); exact zeros where the scored values are all
    equal (as ``_centred``: a mean of equal floats may miss them by an ulp, which the scale would blow up)."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    top = x.nan_to_num(nan=-math.inf).amax(dims, keepdim=True)
    bottom = x.nan_to_num(nan=math.inf).amin(dims, keepdim=True)
    return torch.where(top == bottom, torch.zeros_like(x), x - mean)


def _nan_std(x: Tensor, dim: int | None) -> Tensor:
    """Bessel-corrected std of the non-NaN values over ``dim`` (None: all), kept dims; 0 with fewer than two."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    count = (~torch.isnan(x)).sum(dims, keepdim=True)
    squares = ((x - torch.nanmean(x, dim=dims, keepdim=True)) ** 2).nansum(dims, keepdim=True)
    return torch.where(count > 1, torch.sqrt(squares / (count - 1).clamp(min=1)), torch.zeros_like(squares))


# (grouped [P, G] rewards with NaN rows, eps) -> [P, G]; the names and meaning of ADVANTAGE_SCALES.
_NAN_AWARE_SCALES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "group": lambda grouped, eps: _nan_centred(grouped, 1) / (_nan_std(grouped, 1) + eps),
    "batch": lambda grouped, eps: _nan_centred(grouped, 1) / (_nan_std(grouped, None) + eps),
    "none": lambda grouped, eps: _nan_centred(grouped, 1),
}


# Each: (rewards [P, G, K], weights [K], scale name or None, eps) -> [P, G] advantages (NaN for unscored rows).
def _sum_then_normalize(rewards: Tensor, weights: Tensor, scale: str | None, eps: float) -> Tensor:
    unscored = torch.isnan(rewards).all(-1)  # [P, G]
    total = (rewards * weights).nansum(-1).masked_fill(unscored, math.nan)  # [P, G]
    return lookup(_NAN_AWARE_SCALES, "advantage scale", "group" if scale is None else scale)(total, eps)


def _normalize_then_sum(rewards: Tensor, weights: Tensor, scale: str | None, eps: float) -> Tensor:
    # GDPO: each reward normalised within its group first, so a reward with a wide range cannot drown the others
    # in the sum; then the weighted sum normalised over the batch. Its scaling is fixed: a scale has no place.
    if scale is not None:
        raise ValueError(f"multi-objective aggregation 'normalize_then_sum' normalises each reward per group and the "
                         f"sum over the batch; scale {scale!r} applies to 'sum_then_normalize' only (pass None)")
    unscored = torch.isnan(rewards).all(-1)  # [P, G]
    per_reward = _nan_centred(rewards, 1) / (_nan_std(rewards, 1) + eps)  # [P, G, K]
    total = (per_reward * weights).nansum(-1).masked_fill(unscored, math.nan)  # [P, G]
    return _nan_centred(total, None) / (_nan_std(total, None) + eps)


MULTI_OBJECTIVE_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, str | None, float], Tensor]] = {
    "sum_then_normalize": _sum_then_normalize,
    "normalize_then_sum": _normalize_then_sum,
}


def multi_reward_advantages(rewards: Tensor, group_size: int, weights: Tensor | None = None,
                            aggregation: str = "sum_then_normalize", scale: str | None = None,
                            eps: float = 1e-4) -> Tensor:
    """One advantage per completion from several reward functions' scores (TRL 1.16's
    ``multi_objective_aggregation``; the ``grpo`` estimator's).

    Args:
        rewards: ``[N, K]`` the score of completion ``n`` by reward function ``k``, ``N = P * group_size``, groups
            contiguous; NaN where a function did not score a completion (TRL's ``None``): left out of the weighted
            sum, the means and the spreads. A row of NaN (no function scored it) gets advantage 0.
        group_size: ``G``, completions per prompt.
        weights: ``[K]`` each function's weight (TRL's ``reward_weights``); None: all 1.
        aggregation: a name in ``MULTI_OBJECTIVE_AGGREGATIONS``: ``"sum_then_normalize"`` (TRL's default): the
            weighted sum per completion, then ``group_advantages``' scaling of it by ``scale`` (``"group"`` when
            None, ``"batch"``, ``"none"``); ``"normalize_then_sum"`` (GDPO): each function's scores centred and
            divided by (their group's std + eps), the weighted sum of those, then centred and divided by (its std
            over the batch + eps); ``scale`` must be None (TRL ignores its ``scale_rewards`` there).
        eps: added to every std (TRL: 1e-4).

    Returns:
        ``[N]`` advantages in the rewards' float dtype. Stds are Bessel-corrected, 0 for fewer than two scored
        values; a group (or batch) whose scored values are all equal gets exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D [N, K] (completions x reward functions), got {tuple(rewards.shape)}")
    N, K = rewards.shape
    if group_size < 1 or N % group_size != 0:
        raise ValueError(f"number of completions {N} is not a multiple of group_size {group_size}")
    combine = lookup(MULTI_OBJECTIVE_AGGREGATIONS, "multi-objective aggregation", aggregation)
    if scale is not None:
        lookup(ADVANTAGE_SCALES, "advantage scale", scale)
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    weights = rewards.new_ones(K) if weights is None else torch.as_tensor(weights).to(rewards)
    if weights.shape != (K,):
        raise ValueError(f"weights must be [K]={K} (one per reward function), got {tuple(weights.shape)}")
    advantages = combine(rewards.view(-1, group_size, K), weights, scale, eps)  # [P, G]
    return advantages.reshape(-1).nan_to_num(nan=0.0)  # [N]; unscored rows -> 0
