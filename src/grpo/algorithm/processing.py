"""The sampling controls ``repetition_penalty``, ``min_new_tokens`` and ``min_p``, applied the way
Hugging Face's ``generate`` applies them, for the samplers (one position at a time) and for the
trainer's log-probs (every completion position at once).

Order (``generate``'s): the processors on the raw logits first, ``RepetitionPenaltyLogitsProcessor``
(a logit ``x`` of a token already seen in the row becomes ``x * penalty`` when ``x < 0``, else
``x / penalty``; seen = the prompt's real tokens and the completion's tokens before this one; padding
never counts: ``generate`` (transformers 5) skips each row's leading padding through
``prompt_ignore_length``, the first real position of the attention mask, which for left-padded
prompts is exactly the masked positions excluded here) and ``MinNewTokensLengthLogitsProcessor`` (every EOS id at ``-inf`` while fewer than
``min_new_tokens`` tokens were generated); then the warpers: temperature, top-k, top-p, and
``MinPLogitsWarper`` (a token is removed when its probability is below ``min_p`` times the most
likely token's).

Log-probs of the distribution that was sampled: the repetition penalty and min_new_tokens are
deterministic functions of (logits, tokens before), so the trainer applies exactly them in every
log-prob pass (old, new with gradients, reference) and the ratio is 1 on the first pass. min_p is a
truncation: the log-prob is renormalised over the kept set ``{v : p(v) >= min_p * max p}`` united
with the sampled token itself. At the sampling weights the sampled token is always kept, so this is
the sampler's own log-prob; under updated weights the token may fall below the threshold, and the
union keeps its log-prob finite and differentiable. (top-k/top-p stay out of the log-probs, as in
TRL: finding a top-p set needs a sort of the whole vocabulary per token in the training pass; min_p
needs only a max.)

``B`` rows, ``L`` completion positions, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogprobProcessing:
    """The sampling controls that the log-probs follow (the defaults are off).

    repetition_penalty: > 0; 1 = off.  min_new_tokens: EOS forbidden before this many new tokens.
    min_p: in [0, 1]; 0 = off.  eos_ids: the ids min_new_tokens forbids (the engines' EOS ids).
    """

    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    min_p: float = 0.0
    eos_ids: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return self.repetition_penalty != 1.0 or self.min_new_tokens > 0 or self.min_p > 0.0


# ---------------------------------------------------------------- one position's primitives ([..., V])

def prompt_presence(prompt_ids: Tensor, prompt_mask: Tensor, vocab_size: int) -> Tensor:
    """[B, Lp] ids and mask -> [B, V] bool: the tokens present among each row's real prompt tokens.

    Padding is sent to an extra column that is then dropped (as HF's ``prompt_ignore_length``): a
    plain scatter of ``mask`` values would let a padded position's False overwrite a real True."""
    ids = prompt_ids.masked_fill(prompt_mask == 0, vocab_size)  # [B, Lp]
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids, True)[:, :vocab_size]


def penalize_repeats(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """[..., V] logits, [..., V] bool seen -> [..., V]: HF's repetition penalty (out of place)."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def eos_mask(eos_ids, vocab_size: int, device) -> Tensor:
    """[V] bool: True at the EOS ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor(list(eos_ids), dtype=torch.long, device=device)] = True
    return mask


def min_p_removed(scaled: Tensor, min_p: float) -> Tensor:
    """[..., V] tempered logits -> [..., V] bool: the tokens min-p removes (HF's ``MinPLogitsWarper``
    formula; the most likely token always stays, since ``min_p <= 1``)."""
    probs = torch.softmax(scaled, dim=-1)
    return probs < min_p * probs.amax(dim=-1, keepdim=True)


# ---------------------------------------------------------------- every completion position at once

def processed_token_logprobs(logits: Tensor, completion_ids: Tensor, completion_mask: Tensor, prompt_seen: Tensor,
                             temperature: float, processing: LogprobProcessing,
                             chunk_columns: int | None = None) -> Tensor:
    """Log-prob of each completion token under the processed sampling distribution.

    Args:
        logits: ``[B, L, V]`` raw model logits, position ``t`` predicting ``completion_ids[:, t]``.
        completion_ids: ``[B, L]`` the sampled tokens (the targets, and the context of later positions).
        completion_mask: ``[B, L]`` 1 on real tokens (a prefix of each row). min_new_tokens forbids EOS at
            real positions only: a padding target may equal an EOS id, and its log-prob must stay finite.
        prompt_seen: ``[B, V]`` bool, the tokens of each row's prompt (``prompt_presence``).
        temperature: > 0, applied after the processors, before min_p.
        processing: the controls (see the module docstring for the order and the min_p kept set).
        chunk_columns: completion positions per chunk (all rows at once); None: ``_CHUNK_ELEMENTS // (B V)``.

    Returns:
        ``[B, L]`` in float32 (float64 for float64 logits). Gradients flow to ``logits``; backward
        recomputes each chunk, so only the per-token logsumexp is kept beside the logits (as
        ``token_logprobs``' chunked path). Extra memory: a few ``[B, chunk, V]`` temporaries; which
        tokens came before a position is read off one ``[B, V]`` table of first occurrences, never a
        ``[B, L, V]`` presence mask.
    """
    _check(logits, completion_ids, completion_mask, prompt_seen, temperature)
    chunk = chunk_columns or _default_chunk(logits)
    return _ProcessedLogprobs.apply(logits, completion_ids, completion_mask.bool(), prompt_seen, float(temperature),
                                    processing, chunk)


def processed_token_entropy(logits: Tensor, completion_ids: Tensor, completion_mask: Tensor, prompt_seen: Tensor,
                            temperature: float, processing: LogprobProcessing,
                            chunk_columns: int | None = None) -> Tensor:
    """``[B, L]`` entropy of each position's processed distribution (the min_p kept set united with
    the sampled token, as the log-probs), without gradient; arguments as ``processed_token_logprobs``."""
    _check(logits, completion_ids, completion_mask, prompt_seen, temperature)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(completion_ids.shape, dtype=dtype, device=logits.device)  # [B, L]
    with torch.no_grad():
        for cols, processed, _ in _processed_chunks(logits, completion_ids, completion_mask.bool(), prompt_seen,
                                                    temperature, processing, chunk_columns or _default_chunk(logits)):
            out[:, cols] = torch.special.entr(torch.softmax(processed, dim=-1)).sum(-1)
    return out


# [B, chunk, V] float32 temporaries of 128 MB, as grpo.algorithm.tokens
_CHUNK_ELEMENTS = 2 ** 25


def _default_chunk(logits: Tensor) -> int:
    B, _, V = logits.shape
    return max(1, _CHUNK_ELEMENTS // max(B * V, 1))


def _check(logits: Tensor, completion_ids: Tensor, completion_mask: Tensor, prompt_seen: Tensor,
           temperature: float) -> None:
    if logits.dim() != 3 or completion_ids.shape != logits.shape[:2] or completion_mask.shape != logits.shape[:2]:
        raise ValueError(f"logits [B, L, V], completion_ids and completion_mask [B, L] disagree: "
                         f"{tuple(logits.shape)}, {tuple(completion_ids.shape)}, {tuple(completion_mask.shape)}")
    if prompt_seen.shape != (logits.shape[0], logits.shape[2]):
        raise ValueError(f"prompt_seen must be [B, V] = {(logits.shape[0], logits.shape[2])}, "
                         f"got {tuple(prompt_seen.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def processing_tables(targets: Tensor, prompt_seen: Tensor, processing: LogprobProcessing,
                      vocab_size: int) -> tuple[Tensor | None, Tensor | None]:
    """What every chunk of a sequence's positions reads: ``(first_seen [B, V] or None, eos [V] or None)``.

    first_seen: the completion position each token first appears at (-1: in the prompt; L: never), so a
    token is seen at position j exactly when first_seen < j (one table per sequence; each chunk's
    ``[B, c, V]`` presence is a comparison with it); None without a repetition penalty. eos: True at the
    ids min_new_tokens forbids; None when it is off. ``targets`` [B, L], ``prompt_seen`` [B, V]."""
    first_seen = None
    if processing.repetition_penalty != 1.0:
        B, L = targets.shape
        first_seen = torch.full((B, vocab_size), L, dtype=torch.long, device=targets.device)
        positions = torch.arange(L, device=targets.device).expand(B, L)  # [B, L]
        first_seen.scatter_reduce_(1, targets, positions, reduce="amin").masked_fill_(prompt_seen, -1)
    eos = eos_mask(processing.eos_ids, vocab_size, targets.device) if processing.min_new_tokens > 0 else None
    return first_seen, eos


def process_chunk(raw: Tensor, start: int, tokens: Tensor, real: Tensor, tables: tuple[Tensor | None, Tensor | None],
                  temperature: float, processing: LogprobProcessing,
                  with_factor: bool = False) -> tuple[Tensor, Tensor | None]:
    """One chunk of positions ``start .. start + c - 1``: ``raw`` [B, c, V] float logits -> ``(processed
    [B, c, V], factor [B, c, V] or None)``: the processed, tempered logits with removed tokens at -inf, and
    (``with_factor``, for a hand-written backward) d processed / d raw where not removed (None when it is
    the constant ``1 / temperature``). ``tokens``/``real`` [B, c]: the chunk's targets and real-token mask;
    ``tables``: ``processing_tables``. Differentiable in ``raw`` (plain autograd works through it)."""
    first_seen, eos = tables
    stop = start + raw.shape[1]
    penalty = processing.repetition_penalty
    factor = None
    if first_seen is not None:
        seen = first_seen[:, None, :] < torch.arange(start, stop, device=raw.device)[None, :, None]
        if with_factor:  # d penalized / d x, in the chunk's dtype (a float64 check stays float64)
            factor = torch.full_like(raw, 1 / penalty).masked_fill_(raw < 0, penalty).masked_fill_(~seen, 1.0)
            factor /= temperature
        raw = penalize_repeats(raw, seen, penalty)
    processed = raw / temperature
    if eos is not None:
        early = real & (torch.arange(start, stop, device=raw.device) < processing.min_new_tokens)
        processed = processed.masked_fill(early[..., None] & eos, float("-inf"))
    if processing.min_p > 0.0:
        removed = min_p_removed(processed, processing.min_p)
        removed.scatter_(2, tokens[..., None], False)  # the sampled token always counts
        processed = processed.masked_fill(removed, float("-inf"))
    return processed, factor


def _processed_chunks(logits: Tensor, targets: Tensor, real: Tensor, prompt_seen: Tensor, temperature: float,
                      processing: LogprobProcessing, chunk: int, with_factor: bool = False):
    """Yields ``(columns, processed [B, c, V], factor [B, c, V] or None)`` per chunk of positions
    (``process_chunk`` of each)."""
    B, L, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tables = processing_tables(targets, prompt_seen, processing, V)
    for start in range(0, L, chunk):
        cols = slice(start, min(start + chunk, L))
        raw = logits[:, cols].to(dtype)  # [B, c, V], a copy of the chunk only
        processed, factor = process_chunk(raw, start, targets[:, cols], real[:, cols], tables, temperature,
                                          processing, with_factor)
        yield cols, processed, factor


class _ProcessedLogprobs(torch.autograd.Function):
    """``log_softmax(processed(logits)).gather(targets)`` over chunks of positions; backward recomputes
    each chunk: d out / d x_v = factor_v * (onehot_v(target) - p_v), with p the processed softmax (0 on
    removed tokens, whose value is a constant -inf) and factor_v = (penalty or 1 / penalty for a seen
    token, by the sign of x_v; else 1) / temperature."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, real: Tensor, prompt_seen: Tensor, temperature: float,
                processing: LogprobProcessing, chunk: int) -> Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        picked = torch.empty(targets.shape, dtype=dtype, device=logits.device)  # [B, L]
        lse = torch.empty_like(picked)  # [B, L]
        for cols, processed, _ in _processed_chunks(logits, targets, real, prompt_seen, temperature, processing, chunk):
            lse[:, cols] = torch.logsumexp(processed, dim=-1)
            picked[:, cols] = processed.gather(-1, targets[:, cols, None]).squeeze(-1) - lse[:, cols]
        ctx.save_for_backward(logits, targets, real, prompt_seen, lse)
        ctx.temperature, ctx.processing, ctx.chunk = temperature, processing, chunk
        return picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [B, L]
        logits, targets, real, prompt_seen, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [B, L, V]
        for cols, processed, factor in _processed_chunks(logits, targets, real, prompt_seen, ctx.temperature,
                                                         ctx.processing, ctx.chunk, with_factor=True):
            g_out = grad_out[:, cols, None].to(processed.dtype)  # [B, c, 1]
            g = torch.exp(processed - lse[:, cols, None]).mul_(-g_out)  # [B, c, V]: -p * grad
            g.scatter_add_(-1, targets[:, cols, None], g_out)  # + onehot(target) * grad
            g = g * factor if factor is not None else g / ctx.temperature
            grad[:, cols] = g.to(logits.dtype)
        return grad, None, None, None, None, None, None
