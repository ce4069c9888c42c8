"""Routing replay for Mixture-of-Experts policies (R3): record the experts a pass routed each token to, and make a
later pass over the same tokens use exactly those experts.

Why: the probability ratio of GRPO's update compares the sampler's log-probs with the trainer's. In an MoE model a
token's log-prob also depends on which experts its router picked in each layer, and two passes over the same tokens
can pick differently for reasons that are not the policy's (a KV-cache decode step against a full-sequence pass,
other kernels, staler weights in the sampler): the ratio then swings, and long runs collapse (verl, slime, SkyRL).
Replaying the sampler's choice removes that part of the mismatch; the router still learns, through the weights it
gives the replayed experts.

How: a forward hook on every router module. transformers 5's routers all return ``(router_logits [n, E],
weights [n, k], indices [n, k])`` for the ``n`` tokens of a forward, row-major over its ``[b, T]`` input;
``Recording`` keeps the indices, ``Replaying`` swaps in recorded ones and recomputes their weights from the same
logits as that router does (``ROUTER_WEIGHTS``, per router class). A recorded index of -1 leaves the token's own
routing (a position no pass recorded). What this module does not do is line a rollout's tokens up with a training
pass's: that is the caller's (tokens in the order of the forward's ``[b, T]`` input).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from grpo.models.wrappers import inner_model


def _softmax_weights(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral, ERNIE-4.5-MoE: softmax over every expert, the chosen ones' probabilities,
    renormalised over the top k (Mixtral always; the others as ``norm_topk_prob`` says; ERNIE's sum clamped)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    if hasattr(router, "norm_min"):  # ERNIE-4.5-MoE
        return weights / weights.sum(-1, keepdim=True).clamp(min=router.norm_min)
    if getattr(router, "norm_topk_prob", True):
        return weights / weights.sum(-1, keepdim=True)
    return weights


def _top_logits_softmax(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """GPT-OSS: softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(-1, indices), dim=-1)


def _sigmoid_weights(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3, GLM-4-MoE: the chosen experts' sigmoid scores (the correction bias picks, it does not weigh),
    renormalised as ``norm_topk_prob`` says, times ``routed_scaling_factor``."""
    weights = logits.float().sigmoid().gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# The weights each router class gives a set of chosen experts, from its logits (transformers 5.17's forwards).
ROUTER_WEIGHTS: dict[str, Callable[[torch.nn.Module, Tensor, Tensor], Tensor]] = {
    "Qwen2MoeTopKRouter": _softmax_weights, "Qwen3MoeTopKRouter": _softmax_weights,
    "OlmoeTopKRouter": _softmax_weights, "MixtralTopKRouter": _softmax_weights,
    "Ernie4_5_MoeTopKRouter": _softmax_weights, "GptOssTopKRouter": _top_logits_softmax,
    "DeepseekV3TopkRouter": _sigmoid_weights, "Glm4MoeTopkRouter": _sigmoid_weights,
}


def replay_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of ``model`` in forward order (one per MoE layer). A model with none is not an MoE
    model; one whose routers grpo cannot replay is a ValueError naming them."""
    routers = [m for m in inner_model(model).modules() if type(m).__name__ in ROUTER_WEIGHTS]
    unknown = sorted({type(m).__name__ for m in inner_model(model).modules()
                      if type(m).__name__.lower().endswith("router") and type(m).__name__ not in ROUTER_WEIGHTS})
    if unknown:
        raise ValueError(f"routing replay: {type(inner_model(model)).__name__}'s routers {unknown} are not ones grpo "
                         f"can replay (it knows {sorted(ROUTER_WEIGHTS)})")
    if not routers:
        raise ValueError(f"routing replay: {type(inner_model(model)).__name__} has no Mixture-of-Experts router")
    return routers


class Recording:
    """The experts each router chose while open, per forward: ``take()`` -> [n, layers, k] long for the tokens of the
    forwards since the last take, in their order (a forward's tokens row-major over its ``[b, T]`` input)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = replay_routers(model)
        self.chosen: list[list[Tensor]] = [[] for _ in self.routers]  # per router, one [n, k] per forward

    @contextmanager
    def hooks(self) -> Iterator[Recording]:
        def keep(layer: int):
            return lambda _module, _args, output: self.chosen[layer].append(output[2].detach())

        handles = [router.register_forward_hook(keep(layer)) for layer, router in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def take(self) -> Tensor:
        if any(len(c) != len(self.chosen[0]) for c in self.chosen):
            raise RuntimeError("routing replay: the routers ran an unequal number of forwards while recording")
        taken = torch.stack([torch.cat(c) for c in self.chosen], dim=1)  # [n, layers, k]
        self.chosen = [[] for _ in self.routers]
        return taken


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward here (gradient checkpointing recomputing a layer)."""
    return torch._C._current_graph_task_id() != -1


class Replaying:
    """Each forward while open routes its tokens to the experts ``feed(indices)`` gave for it ([n, layers, k] long,
    -1: the token's own choice), before that forward; a forward with nothing fed routes itself (``unfed`` counts
    them). ``apply=False``: every forward routes itself and only the mismatch is counted (the measure without
    replay). ``mismatch`` counts the (token, layer) pairs whose own choice
    was another set of experts, over ``routed`` recorded pairs (``moe/routing_mismatch``).

    Under gradient checkpointing the backward recomputes each layer's forward, last forward first: a router hook
    that runs inside a backward takes that layer's most recent replayed choice back (so the recompute routes as
    the forward did)."""

    def __init__(self, model: torch.nn.Module, apply: bool = True):
        self.routers = replay_routers(model)
        self.apply = apply  # False: each forward routes itself; the mismatch with the fed experts is only counted
        self.pending: Tensor | None = None
        self.used: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.routers]  # (chosen, known) per forward
        self._mismatch: Tensor | int = 0  # device tensors, summed without a host sync per router
        self._routed: Tensor | int = 0
        self.unfed = 0  # forwards that ran with nothing fed (routed by themselves)

    def feed(self, indices: Tensor) -> None:
        """The next forward's recorded experts, [n, layers, k] (its tokens row-major over its input)."""
        if indices.shape[1] != len(self.routers):
            raise ValueError(f"routing replay: {indices.shape[1]} layers recorded, the model has {len(self.routers)}")
        self.pending = indices

    @contextmanager
    def hooks(self) -> Iterator[Replaying]:
        def replace(layer: int):
            def hook(router, _args, output):
                logits, weights, own = output
                if _in_backward() and self.used[layer]:  # a checkpointed layer recomputed
                    chosen, known = self.used[layer].pop()
                else:
                    if self.pending is None:  # a forward nobody fed (a probe): it routes itself
                        self.unfed += layer == 0
                        return output
                    recorded = self.pending[:, layer].to(own.device, own.dtype)  # [n, k]
                    if recorded.shape != own.shape:
                        raise ValueError(f"routing replay: {tuple(recorded.shape)} recorded choices for a forward "
                                         f"routing {tuple(own.shape)}")
                    known = (recorded >= 0).all(-1, keepdim=True)  # [n, 1]
                    chosen = torch.where(known, recorded, own)
                    differs = (own.sort(-1).values != chosen.sort(-1).values).any(-1) & known.squeeze(-1)
                    self._mismatch = self._mismatch + differs.sum()
                    self._routed = self._routed + known.sum()
                    if not self.apply:
                        if layer == len(self.routers) - 1:
                            self.pending = None
                        return output
                    if torch.is_grad_enabled():
                        self.used[layer].append((chosen, known))
                    if layer == len(self.routers) - 1:
                        self.pending = None  # the next forward needs its own
                replayed = ROUTER_WEIGHTS[type(router).__name__](router, logits, chosen).to(weights.dtype)
                return logits, torch.where(known, replayed, weights), chosen
            return hook

        handles = [router.register_forward_hook(replace(layer)) for layer, router in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.pending = None
            self.used = [[] for _ in self.routers]

    @property
    def mismatch(self) -> int:
        return int(self._mismatch)

    @property
    def routed(self) -> int:
        return int(self._routed)

    def mismatch_fraction(self) -> float:
        """The share of recorded (token, layer) routings the pass would have chosen differently (0 when none)."""
        routed = self.routed
        return self.mismatch / routed if routed else 0.0
