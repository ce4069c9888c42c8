"""The GRPO math: pure functions of tensors, no config objects, ranks or logging.

Layout convention: completions of one prompt are contiguous, rows ``i*G .. i*G+G-1`` belong to
prompt ``i``; ``N = P*G``. ``L`` is the completion length (padded), ``T`` a full sequence length,
``V`` the vocabulary size.

Variants are looked up by name in ``ADVANTAGE_SCALES`` and ``LOSS_AGGREGATIONS``; an unknown name
raises a ``ValueError`` listing the known ones.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_SCALES", "LOSS_AGGREGATIONS", "group_advantages", "token_logprobs", "kl_k3",
           "logprob_mismatch", "policy_loss", "aggregate_loss"]


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None



def _scale_group(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # Bessel-corrected std per group, as TRL; a group of one has no spread (std := 0).
    G = grouped.shape[1]
    std = grouped.std(dim=1, keepdim=True) if G > 1 else torch.zeros_like(grouped[:, :1])
    return centred / (std + eps)


def _scale_batch(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
    return centred / (std + eps)


def _scale_none(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred  # Dr. GRPO: no division, so easy/hard groups are not up-weighted


ADVANTAGE_SCALES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "group": _scale_group,
    "batch": _scale_batch,
    "none": _scale_none,
}


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[N]`` total reward per completion, ``N = P * group_size``, groups contiguous.
        group_size: ``G``, completions per prompt.
        scale: ``"group"``: (r - group mean) / (group std + eps), std with Bessel's correction;
            ``"batch"``: centred per group, divided by the whole batch's std + eps;
            ``"none"``: centred only (Dr. GRPO).
        eps: added to the std so that a near-constant group does not explode.

    Returns:
        ``[N]`` advantages (float32 or the rewards' float dtype). A group whose rewards are all equal
        gets exactly 0 (centring gives exact zeros and 0 / (std + eps) stays 0), also for ``G = 1``.

    Raises:
        ValueError: ``N`` is not a multiple of ``G``, a reward is NaN, or ``scale`` is unknown.
    """
    scale_fn = _lookup(ADVANTAGE_SCALES, "advantage scale", scale)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards {rewards.numel()} is not a multiple of group_size {group_size}")
    if torch.isnan(rewards).any():
        raise ValueError(f"rewards contain NaN at rows {torch.nonzero(torch.isnan(rewards)).flatten().tolist()}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    # All-equal groups: the mean of equal floats can differ from them by one ulp; force exact zeros.
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    return scale_fn(centred, grouped, eps).reshape(-1)  # [N]



def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0,
                   chunk_tokens: int | None = None) -> Tensor:
    """Log-probability of each next token.

    Args:
        logits: ``[B, T, V]`` model outputs of any float dtype; position ``t`` predicts token ``t + 1``.
        input_ids: ``[B, T]`` token ids.
        temperature: logits are divided by it (use the sampling temperature so that the ratio and KL
            are of the distribution that was sampled).
        chunk_tokens: positions per chunk (over the flattened ``B * (T-1)``). None: on a GPU
            ``_CHUNK_ELEMENTS // V``; on a CPU the row loop instead (faster there, see below).

    Returns:
        ``[B, T-1]`` float32: ``log softmax(logits[:, t] / temperature)[input_ids[:, t + 1]]``; the
        caller's logits are never edited.

    Memory (chunked, the GPU's default): positions are taken a chunk at a time, upcast to float32 per
    chunk, so the extra memory is a few ``[chunk, V]`` float32 temporaries (~128 MB each by default),
    never a second ``[B, T, V]``. Under autograd only the per-token logsumexp ``[B, T-1]`` is kept
    beside the logits (which the graph holds anyway); backward recomputes the softmax chunk by chunk
    (``_ChunkedLogprobs``). The CPU's row loop keeps a float32 copy per row for backward when the
    logits are not float32 or the temperature is not 1: a float32 ``[B, T, V]`` in all.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits [B, T, V] and input_ids [B, T] disagree: {tuple(logits.shape)} vs "
                         f"{tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if chunk_tokens is None and not logits.is_cuda:
        # On a CPU the row loop was 5-25% faster (one thread, B=8, T=64, V=518 and 8192, fwd+bwd,
        # fp32 and bf16): no indexed copies, and plain autograd's saved tensors cost no launches there.
        return _row_loop_logprobs(logits, input_ids[:, 1:], temperature)
    chunk = chunk_tokens or max(1, _CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    return _ChunkedLogprobs.apply(logits, input_ids, float(temperature), chunk)  # [B, T-1]


# Elements per [chunk, V] float32 temporary: 128 MB, so a GPU runs few chunks (each is a handful of
# kernel launches): ~20 for 4096 tokens of a 151k vocabulary.
_CHUNK_ELEMENTS = 2 ** 25


def _row_loop_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """[B, T, V] logits, [B, T-1] targets -> [B, T-1] float32, one sequence at a time under plain
    autograd, which keeps each row's float32 upcast (bf16 logits) or scaled copy for backward."""
    rows = []
    for row_logits, row_targets in zip(logits[:, :-1], targets):  # [T-1, V], [T-1]
        scaled = row_logits.float()  # [T-1, V]; no copy when already fp32
        if temperature != 1.0:
            scaled = scaled / temperature  # out of place: the caller's logits are never edited
        picked = scaled.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)  # [T-1]
        rows.append(picked - torch.logsumexp(scaled, dim=-1))  # [T-1]
    return torch.stack(rows)  # [B, T-1]


def _positions(B: int, T: int, device) -> tuple[Tensor, Tensor]:
    # (row, column) of every predicting position t < T-1, row-major: the order of the [B, T-1] output.
    rows = torch.arange(B, device=device).repeat_interleave(T - 1)  # [B*(T-1)]
    cols = torch.arange(T - 1, device=device).repeat(B)  # [B*(T-1)]
    return rows, cols


class _ChunkedLogprobs(torch.autograd.Function):
    """``log_softmax(logits / temperature).gather(targets)`` over chunks of positions.

    Plain autograd would keep each chunk's float32 log-softmax (or its upcast logits) for backward: a
    float32 ``[B, T, V]`` in all. Here backward recomputes the softmax from the saved logits and the
    per-token logsumexp: d out / d logits = (onehot(target) - softmax(logits / temperature)) / temperature.
    Positions are indexed as (row, column) pairs, so the logits may have any strides and are not copied
    whole.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, input_ids: Tensor, temperature: float, chunk: int) -> Tensor:
        B, T, V = logits.shape
        rows, cols = _positions(B, T, logits.device)  # [M], M = B*(T-1)
        targets = input_ids[:, 1:].reshape(-1)  # [M]
        picked = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)  # [M]
        lse = torch.empty_like(picked)  # [M]
        for start in range(0, rows.shape[0], chunk):
            at = slice(start, start + chunk)
            scaled = logits[rows[at], cols[at]].float()  # [c, V], a copy: the caller's logits stay as they are
            if temperature != 1.0:
                scaled = scaled / temperature
            lse[at] = torch.logsumexp(scaled, dim=-1)
            picked[at] = scaled.gather(-1, targets[at, None]).squeeze(-1) - lse[at]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return picked.view(B, T - 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [B, T-1]
        logits, targets, lse = ctx.saved_tensors
        B, T, V = logits.shape
        rows, cols = _positions(B, T, logits.device)
        grad_flat = grad_out.reshape(-1).float()  # [M]
        grad = torch.zeros_like(logits)  # [B, T, V]; the last position predicts nothing
        for start in range(0, rows.shape[0], ctx.chunk):
            at = slice(start, start + ctx.chunk)
            scaled = logits[rows[at], cols[at]].float()  # [c, V]
            if ctx.temperature != 1.0:
                scaled = scaled / ctx.temperature
            g = torch.exp(scaled - lse[at, None]).mul_(-grad_flat[at, None])  # [c, V]: -softmax * grad
            g.scatter_add_(-1, targets[at, None], grad_flat[at, None])  # + onehot(target) * grad
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            grad[rows[at], cols[at]] = g.to(logits.dtype)
        return grad, None, None, None


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman).

    Args:
        logprobs, ref_logprobs: same shape (e.g. ``[N, L]``), log-probs of the sampled tokens.

    Returns:
        Same shape, >= 0 everywhere (x - 1 - log x >= 0), exactly 0 where the two agree.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def logprob_mismatch(sampler_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's, as a masked sum.

    Args:
        sampler_logprobs: ``[N, L]`` the rollout engine's log-prob of each sampled token.
        trainer_logprobs: ``[N, L]`` the trainer's log-prob of the same tokens, same temperature.
        mask: ``[N, L]`` 1 on completion tokens, 0 on padding.

    Returns:
        ``(total, count)``: the sum of |sampler - trainer| over the masked tokens and their number, both
        float64 scalars. A sum and a count rather than the mean, so that ranks can add theirs before
        dividing (the mean over all tokens of the step, not a mean of per-rank means).
    """
    keep = mask.bool()
    gap = (sampler_logprobs.double() - trainer_logprobs.double()).abs()[keep]  # [tokens]
    return gap.sum(), keep.sum().double()



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


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "grpo": _agg_grpo,
    "bnpo": _agg_bnpo,
    "dr_grpo": _agg_dr_grpo,
    "dapo": _agg_dapo,
}


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
    agg = _lookup(LOSS_AGGREGATIONS, "loss_type", loss_type)
    return agg(per_token, mask.to(per_token.dtype), normalizer, max_completion_length)



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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate with a k3 KL penalty.

    Args:
        logprobs: ``[N, L]`` current policy log-probs of the completion tokens (carries the gradient).
        old_logprobs: ``[N, L]`` log-probs under the policy that sampled (detached here).
        ref_logprobs: ``[N, L]`` reference log-probs, or None only when ``beta == 0``.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens.
        mask: ``[N, L]`` 1 for completion tokens (up to and including EOS), 0 for padding.
        epsilon, epsilon_high: ratio clipped to ``[1 - epsilon, 1 + (epsilon_high or epsilon)]``.
        beta: KL coefficient.
        loss_type: aggregation, see ``aggregate_loss``.
        max_completion_length: the ``dr_grpo`` normaliser.
        normalizer: the ``dapo`` global token count (optional).

    Returns:
        ``(loss, stats)``: scalar loss = aggregate of -(min(ratio*A, clip(ratio)*A) - beta*k3);
        stats (detached scalars): ``kl`` (masked mean k3, 0 when no reference), ``clip_fraction``
        (share of masked tokens where clipping changed the objective), ``ratio_mean`` (masked mean),
        ``ratio_max``.
    """
    if beta != 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs may be None only when beta == 0")
    if not (logprobs.shape == old_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N]={logprobs.shape[0]}, got {tuple(advantages.shape)}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    # Padding is masked out of every sum, but inf * 0 is NaN: whatever values the passes left at padded
    # positions (another model's, or 0 where a pass skipped the column) must not overflow exp().
    padding = mask == 0
    logprobs = logprobs.masked_fill(padding, 0.0)
    old_logprobs = old_logprobs.masked_fill(padding, 0.0)
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs.masked_fill(padding, 0.0)
    mask = mask.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)  # [N, 1]
    ratio = torch.exp(logprobs - old_logprobs.detach())  # [N, L]
    unclipped = ratio * adv  # [N, L]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv  # [N, L]
    objective = torch.min(unclipped, clipped)  # [N, L]
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs.detach())  # [N, L]
        if beta != 0:
            objective = objective - beta * kl
    else:
        kl = torch.zeros_like(logprobs)
    loss = aggregate_loss(-objective, mask, loss_type, normalizer=normalizer,
                          max_completion_length=max_completion_length)

    with torch.no_grad():
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
    return loss, {k: v.detach() for k, v in stats.items()}
