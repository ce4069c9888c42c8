"""The rollout engine interface and the helpers every engine shares."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from grpo.rollout.generation import Generation

if TYPE_CHECKING:
    from grpo.weight_store.layout import LoadedWeights


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. ``temperature == 0`` or ``greedy`` means argmax decoding (of the logits
    after the repetition penalty and min_new_tokens, which ``generate`` applies when greedy too)."""

    n: int = 1  # completions per prompt (G)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    # Hugging Face's processors (see grpo.algorithm.processing; all engines apply them as generate does):
    repetition_penalty: float = 1.0  # a seen token's logit x -> x / p (x >= 0) or x * p (x < 0); 1 = off
    min_new_tokens: int = 0  # every EOS id is forbidden before this many new tokens
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability (after top-k/top-p); 0 = off


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        """Sample ``params.n`` completions for each rendered prompt; rows grouped per prompt."""
        ...


@runtime_checkable
class TokenIdsEngine(Protocol):
    """An engine that samples from token ids as they are (no re-tokenising), so that a multi-turn row
    continues from its exact ids (``grpo.multiturn.driver``). Every grpo engine has it; its ``generate``
    is tokenising then ``generate_ids``, so the two give the same rows for the same seed."""

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     seed: int | None = None) -> Generation:
        """``generate`` for prompts given as [P] lists of token ids; the ``Generation`` is the same record."""
        ...


@runtime_checkable
class PrefixCachingEngine(TokenIdsEngine, Protocol):
    """An engine that can keep the rows' keys/values from one ``generate_ids`` call to the next, so that a
    multi-turn row's next turn prefills only its new tokens (the sampled turn's last token and the tool
    result), not the whole conversation again (``grpo.rollout.prefix_cache``)."""

    def cached_turns(self) -> AbstractContextManager[TokenIdsEngine]:
        """A context whose engine continues each prompt from the longest cached row it extends. The cache
        is freed when the context exits, so it cannot outlive the rollout (the weights change after it)."""
        ...


@runtime_checkable
class OwnWeightsEngine(RolloutEngine, Protocol):
    """An engine that samples from its own copy of the weights (vLLM), not from the policy module: the
    trainer hands it every new version, and its generations carry its own ``sampler_logprobs``."""

    def update_weights(self, weights: LoadedWeights) -> None:
        """Sample from ``weights`` (a full state dict, or a LoRA adapter over the base) from now on."""
        ...


def completion_mask_from_ids(completion_ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask of real completion tokens: up to and including the first EOS.

    Args:
        completion_ids: [N, L] generated token ids (anything after the first EOS is padding, even when
            the pad id equals an EOS id).
        eos_ids: token ids that end a completion.

    Returns:
        (mask [N, L] long, truncated [N] bool): truncated rows have no EOS, all L tokens count.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))  # [N, L]
    has_eos = is_eos.any(dim=1)  # [N]
    L = completion_ids.shape[1]
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, L, dtype=torch.long))
    positions = torch.arange(L, device=completion_ids.device).unsqueeze(0)  # [1, L]
    mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, L]; the EOS itself is included
    return mask, ~has_eos
