"""Per-token log-probs of completion tokens under a model, in micro-batches."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algorithm import token_logprobs


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B, T] positions that skip left padding, as ``generate`` assigns them (so log-probs of a
    left-padded prompt match what was sampled)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float,
    micro_batch_size: int | None = None,
) -> Tensor:
    """Log-probs of each completion token given its prompt and the completion prefix.

    Args:
        prompt_ids, prompt_mask: [N, Lp] left-padded prompts.
        completion_ids, completion_mask: [N, Lc] right-padded completions.
        temperature: the sampling temperature (logits are divided by it).
        micro_batch_size: rows per forward pass; None = all at once.

    Returns:
        [N, Lc] float32 (padding positions hold finite values that the loss masks out). Gradients flow
        when called with grad enabled. Only the last ``Lc + 1`` positions' logits are computed
        (``logits_to_keep``), never the prompt's [Lp, V] logits.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, T]
    Lc = completion_ids.shape[1]
    step = micro_batch_size or input_ids.shape[0]
    device = next(model.parameters()).device
    out = []
    for start in range(0, input_ids.shape[0], step):
        ids = input_ids[start:start + step].to(device)
        mask = attention_mask[start:start + step].to(device)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
            logits_to_keep=Lc + 1, use_cache=False,
        ).logits  # [b, Lc + 1, V]: positions Lp-1 .. T-1, each predicting the next token
        out.append(token_logprobs(logits, ids[:, -(Lc + 1):], temperature))  # [b, Lc]
    return torch.cat(out)
