"""The router logits of a log-prob pass over a Mixture-of-Experts policy, pooled into its load-balancing loss
(``loss.router_aux_loss_coef``; the loss itself: ``grpo.algorithm.load_balancing_loss``).

The loss is TRL's: over every real token of the micro-batch's rows, prompt and completion, padding left out. The
passes of ``grpo.step.logprobs`` route other token sets (a prompt run once for the rows that share it, a completion
pass over a cached prompt, packed rows); each forward's tokens come with a weight (0 for padding, the number of rows
for a shared prompt's tokens), so that every pass gives the loss of the plain one, up to float re-association.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from grpo.algorithm import load_balancing_loss
from grpo.models.wrappers import decoder, inner_model


class RoutedTokens:
    """The router logits of one ``completion_logprobs`` call's forwards, each token with its weight.

    The logits are taken by forward hooks on the router modules the model declares (transformers' own record of
    ``router_logits``, ``_can_record_outputs``), not by ``output_router_logits=True``: with that flag the model also
    computes its own auxiliary loss over the attention mask it was given, which does not line up with the routed
    tokens when a forward reads a KV cache (the shared prompt pass's completion pass): a shape error."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.top_k = top_k
        self.routers = router_modules(model)
        self.pending: list[Tensor] = []  # this forward's logits so far, one [n, E] per MoE layer
        self.forwards: list[tuple[tuple[Tensor, ...], Tensor]] = []  # (per layer [n, E], weights [n]) per forward

    @contextmanager
    def recording(self) -> Iterator[RoutedTokens]:
        """Hooks on the routers while open: every forward's router logits are kept until ``add`` takes them."""
        def keep(index: int):
            return lambda _module, _args, output: self.pending.append(output[index])

        handles = [module.register_forward_hook(keep(index)) for module, index in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def add(self, weights: Tensor) -> None:
        """The forward that just ran routed ``weights.numel()`` tokens ([b, T]) with these weights."""
        # each router runs once per forward; anything before (a probe forward of the fused head's) is not this one's
        logits, self.pending = tuple(self.pending[-len(self.routers):]), []
        if len(logits) < len(self.routers):
            raise RuntimeError(f"grpo.step.router_logits: the forward ran {len(logits)} of the model's "
                               f"{len(self.routers)} routers")
        self.forwards.append((logits, weights.reshape(-1)))

    def discard_last(self) -> None:
        """Forget the last forward (a pass abandoned for another over the same tokens)."""
        self.forwards.pop()

    def loss(self) -> Tensor:
        """0-d: the load-balancing loss of every token collected, pooled over the forwards and layers."""
        layers = len(self.forwards[0][0])
        pooled = [torch.cat([logits[layer] for logits, _ in self.forwards]) for layer in range(layers)]  # [n, E]
        return load_balancing_loss(pooled, self.top_k, torch.cat([weights for _, weights in self.forwards]))


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(module, index of the router logits in its output) for every router of ``model``, as transformers' base
    model declares them in ``_can_record_outputs["router_logits"]`` (a class, or an ``OutputRecorder`` of one)."""
    base = decoder(model)
    specs = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    specs = specs if isinstance(specs, list) else [specs] if specs is not None else []
    # a bare class records its output's item 1 (transformers' default outside hidden states)
    targets = [(spec, 1) if isinstance(spec, type) else (spec.target_class, spec.index) for spec in specs]
    found = [(module, index) for module in base.modules() for cls, index in targets
             if cls is not None and isinstance(module, cls)]
    if not found:
        raise ValueError(f"{type(inner_model(model)).__name__} declares no router modules (transformers' "
                         "_can_record_outputs['router_logits']): grpo cannot add its load-balancing loss")
    return found


def shared_prompt_weights(prompt_mask: Tensor, index: Tensor) -> Tensor:
    """[U, Lp]: each distinct prompt's tokens counted once per row that shares it (``index`` [b]: each row's prompt),
    its padding 0: what the plain pass would route."""
    rows = torch.bincount(index, minlength=prompt_mask.shape[0]).to(prompt_mask.device)  # [U]
    return prompt_mask.float() * rows[:, None]
