"""PPO's token-level advantages: sequence reward (and per-token KL penalty) -> token rewards -> GAE
over the critic's values -> whitened advantages and the critic's return targets.

Multi-turn rows: the actions are the sampled tokens only. Tokens an environment inserted (tool
results) are part of the transition from one action's state to the next, so GAE chains each action to the
next *sampled* token (its ``V``, of a state that includes the inserted tokens as context), skipping them.

A composition of ``grpo.algorithm``'s pure functions (``kl_penalized_token_rewards``,
``gae_advantages``, ``whiten``), kept pure itself: tensors in, tensors out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algorithm import gae_advantages, kl_penalized_token_rewards, whiten


def ppo_advantages(sequence_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float,
                   kl: Tensor | None = None, kl_coef: float = 0.0) -> tuple[Tensor, Tensor]:
    """Whitened GAE advantages and returns for a batch of completions.

    Args:
        sequence_rewards: ``[N]`` total reward of each completion (placed at its last real token).
        values: ``[N, L]`` the critic's values of the states before each completion token, at sampling.
        mask: ``[N, L]`` 1 on each row's actions: its sampled tokens (at least one per row). Single-turn, the
            real tokens (a prefix); multi-turn, environment tokens between turns are 0 (see the module docstring).
        gamma, lam: GAE's discount and trade-off (``gae_advantages``).
        kl: ``[N, L]`` per-token KL estimate against the reference, or None for no penalty in the reward.
        kl_coef: its weight: ``r_t = -kl_coef * KL_t`` on every real token (PPO's KL in the reward).

    Returns:
        ``(advantages, returns)``, both ``[N, L]``, 0 on padding and environment tokens, no gradient. ``advantages`` are
        whitened over the batch's real tokens (mean 0, std 1, as PPO does); ``returns = GAE + V`` are
        not (they are the critic's regression targets, in reward units).
    """
    if kl is None:
        kl = values.new_zeros(values.shape)
    # GAE runs over each row's actions packed to the left (a prefix mask, as gae_advantages takes), then the
    # results go back to their positions. A prefix mask packs to itself: single-turn numbers are unchanged.
    order = actions_first(mask)  # [N, L]
    packed = (torch.arange(mask.shape[1], device=mask.device) < mask.sum(-1, keepdim=True)).to(mask.dtype)  # [N, L]
    token_rewards = kl_penalized_token_rewards(sequence_rewards.to(values.dtype),
                                               kl.to(values.dtype).gather(1, order), packed, kl_coef)  # [N, L]
    packed_advantages, packed_returns = gae_advantages(token_rewards, values.gather(1, order), packed, gamma, lam)
    advantages = torch.zeros_like(packed_advantages).scatter_(1, order, packed_advantages)  # [N, L]
    returns = torch.zeros_like(packed_returns).scatter_(1, order, packed_returns)  # [N, L]
    return whiten(advantages, mask), returns


def actions_first(mask: Tensor) -> Tensor:
    """``[N, L]`` 0/1 mask -> ``[N, L]`` long, per row the positions where ``mask`` is 1, in order, then the
    others, in order: ``x.gather(1, order)`` packs a row's actions to the left."""
    L = mask.shape[1]
    positions = torch.arange(L, device=mask.device).expand(mask.shape)  # [N, L]
    return torch.argsort(positions + L * (mask == 0).long(), dim=1)  # distinct keys: the order is exact
