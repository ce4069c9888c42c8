"""Per-token quantities read off the logits: log-probs of the sampled tokens and the entropy of the
distribution they were sampled from. Both are chunked over positions so that no second ``[B, T, V]``
float32 copy of the logits is ever made.

``B`` rows, ``T`` positions, ``V`` vocabulary; position ``t`` predicts token ``t + 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


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


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None) -> Tensor:
    """Entropy of each position's next-token distribution, without gradient (a diagnostic).

    Args:
        logits: ``[B, T, V]`` model outputs of any float dtype, as ``token_logprobs`` takes them.
        temperature: logits are divided by it, so the entropy is that of the distribution sampled from.
        chunk_tokens: positions per chunk (over the flattened ``B * (T-1)``); None: ``_CHUNK_ELEMENTS // V``.

    Returns:
        ``[B, T-1]``: ``H_t = -sum_v p_v log p_v`` with ``p = softmax(logits[:, t] / temperature)``, for
        the positions ``t < T-1`` that ``token_logprobs`` scores (the last one predicts nothing kept).
        float32, or float64 for float64 logits. 0 for a one-hot distribution, ``log V`` for a uniform one.

    Memory: each chunk is gathered, upcast and turned into probabilities on its own, so the extra memory
    is a few ``[chunk, V]`` temporaries, never a float32 ``[B, T, V]``. Called on the logits the training
    forward already holds, it costs one more read of them and no model pass.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    B, T, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    chunk = chunk_tokens or max(1, _CHUNK_ELEMENTS // max(V, 1))
    rows, cols = _positions(B, T, logits.device)  # [M], M = B*(T-1)
    out = torch.empty(rows.shape[0], dtype=dtype, device=logits.device)  # [M]
    with torch.no_grad():
        for start in range(0, rows.shape[0], chunk):
            at = slice(start, start + chunk)
            scaled = logits[rows[at], cols[at]].to(dtype)  # [c, V], a copy of the chunk only
            if temperature != 1.0:
                scaled = scaled / temperature
            # entr(p) = -p log p with entr(0) = 0: a vocabulary entry at -inf adds nothing, not NaN.
            out[at] = torch.special.entr(torch.softmax(scaled, dim=-1)).sum(-1)
    return out.view(B, T - 1)


def entropy_of_scores(scores: Tensor) -> Tensor:
    """``[..., V] -> [...]``: the entropy of ``softmax(scores)`` as ``logsumexp(s) - sum(p * s)``, whose gradient is
    finite everywhere (``-p log p``'s is not at p = 0, where float32 puts every unlikely token). For a bonus in
    the loss (``grpo.algorithm.entropy``); scores are the tempered logits, float32 or wider."""
    return torch.logsumexp(scores, dim=-1) - (torch.softmax(scores, dim=-1) * scores).sum(-1)


def token_entropy_with_grad(logits: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None) -> Tensor:
    """``token_entropy`` with its gradient to the logits (TRL's entropy bonus), ``[B, T-1]`` float32 (float64 for
    float64 logits).

    Memory: each chunk runs under activation checkpointing, so backward recomputes its float32 softmax instead of
    keeping one: a float32 ``[B, T, V]`` never exists, only each chunk's copy of its logits (in their dtype)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, T, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    chunk = chunk_tokens or max(1, _CHUNK_ELEMENTS // max(V, 1))
    rows, cols = _positions(B, T, logits.device)  # [M], M = B*(T-1)

    def chunk_entropy(scores: Tensor) -> Tensor:  # [c, V] -> [c]
        return entropy_of_scores(scores.to(dtype) / temperature)

    parts = [checkpoint(chunk_entropy, logits[rows[start:start + chunk], cols[start:start + chunk]],
                        use_reentrant=False) for start in range(0, rows.shape[0], chunk)]
    return (torch.cat(parts) if parts else logits.new_zeros(0, dtype=dtype)).view(B, T - 1)
