"""The Mixture-of-Experts load-balancing loss (Switch Transformer's, eqs. 4-6, as transformers' Mixtral, Qwen3-MoE,
GPT-OSS and ERNIE-4.5-MoE compute it): ``E x sum_i f_i x P_i``, with ``f_i`` the share of the top-k assignments that
go to expert i and ``P_i`` its mean router probability, both over every routed token of every MoE layer pooled
(not a mean of per-layer losses). TRL 1.16 adds ``router_aux_loss_coef`` times it to the GRPO loss.

``T`` routed tokens, ``E`` experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int, weights: Tensor | None = None) -> Tensor:
    """0-d float32 load-balancing loss of one forward's routing, with the router logits' gradient.

    Args:
        router_logits: one ``[T, E]`` tensor per MoE layer, the same ``T`` tokens in each (the logits before the
            softmax; a router that ranks raw logits, GPT-OSS's, is scored on their softmax all the same).
        top_k: experts each token is sent to.
        weights: ``[T]`` how many times each token counts: 0 for padding (transformers' attention mask), an integer
            count for a token that stands for several (a prompt run once for the G completions that share it);
            None: every token once.

    Returns:
        ``E * sum_i f_i * P_i``, where over the layers and tokens with their weights ``f_i`` is the weighted count of
        top-k choices of expert i over the weighted token count (so ``sum_i f_i = top_k``) and ``P_i`` the weighted
        sum of its softmax probability over the same count. Only ``P`` carries gradient (top-k is a selection).
        Integer weights give exactly the loss of the tokens repeated that many times.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    w = (torch.ones(router_logits[0].shape[0], device=device) if weights is None
         else weights.reshape(-1).to(device=device, dtype=torch.float32))  # [T]
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E] weighted top-k counts
    probability = torch.zeros(num_experts, dtype=torch.float32, device=device)  # [E] weighted probability sums
    for layer in router_logits:
        if layer.shape != router_logits[0].shape:
            raise ValueError(f"router logits {tuple(layer.shape)} and {tuple(router_logits[0].shape)} differ: every "
                             "layer must route the same tokens")
        probs = torch.softmax(layer.float(), dim=-1)  # [T, E]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [T, k]
        assigned = assigned.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probability = probability + (probs * w[:, None]).sum(0)
    rows = (w.sum() * len(router_logits)).clamp(min=1)  # weighted tokens x layers (no token: a loss of 0)
    return num_experts * ((assigned / rows) * (probability / rows)).sum()
