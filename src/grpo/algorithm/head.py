"""Log-probs (and entropy) of the sampled tokens straight from the final hidden states: the LM head is
applied a chunk of positions at a time, so no ``[B, L, V]`` logits tensor ever exists.

With Qwen's 151,936-token vocabulary the logits, not the model, decide what fits: one micro-batch of
8 x 1,024 completion tokens is 2.5 GB of bf16 logits, plus the float32 work around them. Here each chunk's
logits are made, read and dropped; under autograd each chunk runs under activation checkpointing, which
keeps only the chunk's hidden states (a view of ones the model holds anyway) and recomputes its logits in
backward. The price is one more head matmul per token in a training pass (2 x H x V FLOPs).

``B`` rows, ``L`` positions, ``H`` hidden size, ``V`` vocabulary; position ``t`` predicts ``targets[:, t]``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grpo.algorithm.processing import LogprobProcessing, process_chunk, processing_tables
from grpo.algorithm.tokens import entropy_of_scores

# Elements of one chunk's [B, c, V] logits: 2^25 (128 MB in float32), as grpo.algorithm.tokens' chunks.
CHUNK_ELEMENTS = 2 ** 25


def head_logprobs(hidden: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor, temperature: float, *,
                  vocab_size: int, with_entropy: bool = False, entropy_grad: bool = False,
                  processing: LogprobProcessing | None = None, real: Tensor | None = None,
                  prompt_seen: Tensor | None = None, chunk_columns: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token, and optionally the entropy of each position's distribution.

    Args:
        hidden: ``[B, L, H]`` final hidden states (after the model's last norm), position ``t`` predicting
            ``targets[:, t]``.
        head: the LM head, ``[B, c, H] -> [B, c, V]`` logits (the model's own output-embedding module, so
            LoRA on it, tied weights and autocast apply as in the model's forward).
        targets: ``[B, L]`` token ids.
        temperature: > 0; the logits (after the processors, if any) are divided by it.
        vocab_size: V, the head's output width.
        with_entropy: also return the entropy, without gradient; with ``entropy_grad`` (and no processing) with its
            gradient, recomputed in backward with the chunk's logits (an entropy bonus).
        processing: the sampling controls (``grpo.algorithm.processing``); None or inactive: the tempered
            logits as they are. With it, ``real`` [B, L] (1 on real tokens) and ``prompt_seen`` [B, V].
        chunk_columns: positions per chunk (all rows at once); None: ``CHUNK_ELEMENTS // (B V)``.

    Returns:
        ``([B, L] log-probs, [B, L] entropy or None)``, float32 (float64 for a float64 head); equal to
        ``token_logprobs`` / ``processed_token_logprobs`` on ``head(hidden)`` up to float re-association. Gradients flow to
        ``hidden`` and to the head's parameters when grad is enabled.
    """
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden [B, L, H] and targets [B, L] disagree: {tuple(hidden.shape)} vs "
                         f"{tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    processing = processing if processing is not None and processing.active else None
    if processing is not None and (real is None or prompt_seen is None):
        raise ValueError("head_logprobs with processing needs real [B, L] and prompt_seen [B, V]")
    B, L, _ = hidden.shape
    chunk = chunk_columns or max(1, CHUNK_ELEMENTS // max(B * vocab_size, 1))
    tables = (processing_tables(targets, prompt_seen, processing, vocab_size) if processing is not None
              else (None, None))
    real = real.bool() if real is not None else None
    entropies: dict[int, Tensor] = {}

    if entropy_grad and processing is not None:
        raise ValueError("head_logprobs: an entropy with gradient is of the plain tempered logits; not with processing")

    def chunk_logprobs(h: Tensor, start: int) -> Tensor | tuple[Tensor, Tensor]:  # [B, c, H] -> [B, c] (, [B, c])
        cols = slice(start, start + h.shape[1])
        scores = head(h)  # [B, c, V]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # float32 (float64 stays)
        if processing is None:
            scores = scores / temperature if temperature != 1.0 else scores
        else:
            scores, _ = process_chunk(scores, start, targets[:, cols], real[:, cols], tables, temperature, processing)
        logprobs = scores.gather(-1, targets[:, cols, None]).squeeze(-1) - torch.logsumexp(scores, dim=-1)
        if entropy_grad:
            return logprobs, entropy_of_scores(scores)
        if with_entropy and start not in entropies:  # the first run only, not checkpointing's recompute
            with torch.no_grad():
                entropies[start] = torch.special.entr(torch.softmax(scores, dim=-1)).sum(-1)
        return logprobs

    checkpointed = torch.is_grad_enabled()
    out = []
    for start in range(0, L, chunk):
        h = hidden[:, start:start + chunk]  # [B, c, H]
        part = checkpoint(chunk_logprobs, h, start, use_reentrant=False) if checkpointed else chunk_logprobs(h, start)
        if entropy_grad:
            part, entropies[start] = part
        out.append(part)
    logprobs = torch.cat(out, dim=1) if out else hidden.new_zeros(B, 0, dtype=torch.float32)
    entropy = None
    if with_entropy or entropy_grad:
        entropy = (torch.cat([entropies[s] for s in sorted(entropies)], dim=1) if entropies
                   else hidden.new_zeros(B, 0, dtype=torch.float32))
    return logprobs, entropy
