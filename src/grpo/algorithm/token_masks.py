"""Which tokens keep their policy loss: TRL 1.16's high-entropy mask (``top_entropy_quantile``, "Beyond the 80/20
Rule") and off-policy sequence mask (``off_policy_mask_threshold``, DeepSeek-V3.2's OPSM).

Both are 0/1 factors on the surrogate only (``policy_loss``'s ``loss_token_mask``: the KL term and the aggregation's
token counts keep every token). ``N`` completions of padded length ``L``; masks ``[N, L]``, 1 for loss tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, pooled: Tensor | None = None) -> Tensor:
    """The loss tokens whose entropy is in the top ``top_quantile`` of the loss tokens' entropies.

    Only the tokens that carry the loss enter the quantile and only they can be kept: padding and environment
    tokens neither move the threshold nor pass it, whatever entropy they hold.

    Args:
        entropy: ``[N, L]`` per-token entropy of the policy's distribution (nats, >= 0; detached here).
        mask: ``[N, L]`` 1 for the tokens that carry the loss.
        top_quantile: ``rho`` in [0, 1] (TRL's ``top_entropy_quantile``): a token is kept when its entropy is at
            least the ``1 - rho`` quantile (linear interpolation, ``torch.quantile``) of the pooled entropies.
            1 keeps every loss token, 0 only those at the largest entropy.
        pooled: ``[M]`` the entropies the quantile is taken over; None: the loss tokens of this batch. TRL pools
            the loss tokens of every rank's micro-batch (a gather): pass them here to do the same.

    Returns:
        ``[N, L]`` bool; all False when there is no entropy to pool. The quantile is taken in float32 whatever the
        dtype, as TRL takes it: torch's float32 interpolation can land a hair above a token sitting exactly on the
        quantile (torch 2.15 does), and only the same arithmetic keeps or drops that token as TRL does.
    """
    if not 0.0 <= top_quantile <= 1.0:
        raise ValueError(f"top_quantile must be in [0, 1], got {top_quantile}")
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} differ")
    keep = mask.bool()
    entropy = entropy.detach()
    values = entropy[keep] if pooled is None else pooled.detach().reshape(-1)  # [M]
    if values.numel() == 0:
        return torch.zeros_like(keep)
    threshold = torch.quantile(values.float(), 1.0 - top_quantile)
    return (entropy >= threshold) & keep


def off_policy_mask(advantages: Tensor, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``get_off_policy_mask``): a completion with a negative
    advantage is dropped when the policy that sampled it is, on average over its tokens, more than ``threshold``
    away from the current one, ``mean_t(log pi_sampler - log pi) > threshold``. A negative advantage pushes the
    sampled tokens down, and on tokens the current policy has already moved away from, that push is noise.

    Args:
        advantages: ``[N]`` or ``[N, L]``; a completion with ``A >= 0`` is always kept.
        logprobs: ``[N, L]`` current policy log-probs (detached here).
        sampler_logprobs: ``[N, L]`` log-probs of the policy that sampled: the sampler's own when another engine
            sampled (vLLM), else the old log-probs. NaN (a token the engine could not score) counts as 0.
        mask: ``[N, L]`` 1 for the tokens that carry the loss; the mean runs over them (an empty row's is 0).
        threshold: ``delta`` of the paper (TRL's ``off_policy_mask_threshold``, e.g. 0.5).

    Returns:
        bool, ``[N, 1]`` for ``[N]`` advantages (one flag per completion), ``[N, L]`` for per-token advantages.
    """
    if not (logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}")
    m = mask.to(logprobs.dtype)
    kl = torch.nan_to_num(sampler_logprobs.to(logprobs.dtype) - logprobs.detach(), nan=0.0)  # [N, L]
    kl = kl.masked_fill(mask == 0, 0.0)  # padding may hold anything (inf * 0 would be NaN)
    mean_kl = kl.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    adv = advantages.detach() if advantages.dim() == 2 else advantages.detach().unsqueeze(1)  # [N, 1] or [N, L]
    return (adv >= 0) | (mean_kl <= threshold)
