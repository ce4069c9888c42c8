"""PPO's token-level advantages: sequence reward (and per-token KL penalty) -> token rewards -> GAE
over the critic's values -> whitened advantages and the critic's return targets.

A composition of ``grpo.algorithm``'s pure functions (``kl_penalized_token_rewards``,
``gae_advantages``, ``whiten``), kept pure itself: tensors in, tensors out.
"""

from __future__ import annotations

from torch import Tensor

from grpo.algorithm import gae_advantages, kl_penalized_token_rewards, whiten


def ppo_advantages(sequence_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float,
                   kl: Tensor | None = None, kl_coef: float = 0.0) -> tuple[Tensor, Tensor]:
    """Whitened GAE advantages and returns for a batch of completions.

    Args:
        sequence_rewards: ``[N]`` total reward of each completion (placed at its last real token).
        values: ``[N, L]`` the critic's values of the states before each completion token, at sampling.
        mask: ``[N, L]`` 1 on each row's real tokens (a prefix, at least one per row).
        gamma, lam: GAE's discount and trade-off (``gae_advantages``).
        kl: ``[N, L]`` per-token KL estimate against the reference, or None for no penalty in the reward.
        kl_coef: its weight: ``r_t = -kl_coef * KL_t`` on every real token (PPO's KL in the reward).

    Returns:
        ``(advantages, returns)``, both ``[N, L]``, 0 on padding, no gradient. ``advantages`` are
        whitened over the batch's real tokens (mean 0, std 1, as PPO does); ``returns = GAE + V`` are
        not (they are the critic's regression targets, in reward units).
    """
    if kl is None:
        kl = values.new_zeros(values.shape)
    token_rewards = kl_penalized_token_rewards(sequence_rewards.to(values.dtype), kl.to(values.dtype), mask,
                                               kl_coef)  # [N, L]
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma, lam)  # [N, L] each
    return whiten(advantages, mask), returns
