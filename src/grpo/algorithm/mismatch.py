"""How far the data a step trains on is from the trainer: the sampler/trainer mismatch of the sampled tokens
and the staleness of the weights that sampled each token (decoupled mode: a token records its policy version).

``N`` completions of padded length ``L``; masks are ``[N, L]``, 1 on the sampled tokens. Every function returns
sums, maxima and counts rather than means, so that micro-batches (and ranks) add theirs before dividing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MismatchSums:
    """One batch's mismatch, as float64 0-d tensors: ``k3`` the sum over the sampled tokens of the k3 estimate
    of KL(sampler || trainer), ``ratio_max`` the largest trainer/sampler probability ratio (0 with no token),
    ``masked`` the sampled tokens the correction dropped from the loss, ``tokens`` the sampled tokens."""

    k3: Tensor
    ratio_max: Tensor
    masked: Tensor
    tokens: Tensor


def mismatch_sums(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                  is_weights: Tensor | None = None) -> MismatchSums:
    """The sampler/trainer mismatch of the sampled tokens.

    With ``r_t = trainer_t - sampler_t`` (log-probs of the sampled token), the k3 estimator of
    KL(sampler || trainer) over tokens the sampler drew is ``exp(r_t) - 1 - r_t`` (>= 0, 0 iff equal); the
    ratio is ``exp(r_t)``.

    Args:
        trainer_logprobs: ``[N, L]`` the trainer's log-probs of the sampled tokens at the weights that start the update.
        sampler_logprobs: ``[N, L]`` the sampler's own log-probs of the same tokens (padding may hold anything).
        mask: ``[N, L]`` 1 on the sampled tokens.
        is_weights: ``[N, L]`` the sampler correction's weights (``sampler_importance_weights``), or None when
            it is off: a sampled token whose weight is 0 is masked (IcePop's band, sequence-level MIS).

    Returns:
        ``MismatchSums`` (detached, float64).
    """
    if not (trainer_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: trainer_logprobs {tuple(trainer_logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}")
    with torch.no_grad():
        keep = mask.bool()
        log_ratio = (trainer_logprobs.double() - sampler_logprobs.double()).masked_fill(~keep, 0.0)  # [N, L]
        ratio = torch.exp(log_ratio)
        k3 = ((ratio - 1.0 - log_ratio) * keep).sum()
        # numel, not keep.any(): no host sync (the update sums these per micro-batch on the device)
        ratio_max = ratio.masked_fill(~keep, 0.0).amax() if ratio.numel() else ratio.new_zeros(())
        masked = ((is_weights == 0) & keep).sum().double() if is_weights is not None else ratio.new_zeros(())
        return MismatchSums(k3, ratio_max, masked, keep.sum().double())


def token_staleness(token_versions: Tensor, mask: Tensor, version: int) -> tuple[float, float]:
    """``(mean, max)`` over the sampled tokens of how many versions the weights that sampled each token are
    behind ``version`` (the trainer's weights at the update: version ``step - 1``); ``(0.0, 0.0)`` without any.

    Args:
        token_versions: ``[N, L]`` integer, the policy version that produced each token (read under ``mask``).
        mask: ``[N, L]`` 1 on the sampled tokens.
        version: the trainer's current weights' version.
    """
    if token_versions.shape != mask.shape:
        raise ValueError(f"shape mismatch: token_versions {tuple(token_versions.shape)}, mask {tuple(mask.shape)}")
    behind = (version - token_versions.long())[mask.bool()].double()  # [tokens]
    if behind.numel() == 0:
        return 0.0, 0.0
    return float(behind.mean()), float(behind.max())


def oldest_version(token_versions: Tensor, mask: Tensor) -> int | None:
    """The oldest policy version among the sampled tokens (the staleness rule's), None without any."""
    versions = token_versions[mask.bool()]  # [tokens]
    return int(versions.min()) if versions.numel() else None
