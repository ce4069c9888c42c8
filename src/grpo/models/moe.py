"""Mixture-of-Experts models as grpo trains them: which ones return their router logits, the load-balancing loss's
coefficient (``loss.router_aux_loss_coef``, TRL 1.16's ``router_aux_loss_coef``), and the router-logits switch
grpo keeps off in the model's config and asks for per forward.

transformers' MoE families with a Switch-style router (Mixtral, Qwen2/3-MoE, GPT-OSS, ERNIE-4.5-MoE, OLMoE, ...)
declare ``output_router_logits`` in their config; DeepSeek-V3 and GLM-4-MoE balance their experts with a bias on
the routing scores and have no auxiliary loss to add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import ConfigError
from grpo.models.wrappers import inner_model


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing loss an update adds: ``coef`` x ``grpo.algorithm.load_balancing_loss`` of each
    micro-batch's routing, its experts chosen ``top_k`` at a time."""

    coef: float
    top_k: int


def _text_config(model: torch.nn.Module):
    config = inner_model(model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def returns_router_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` can return its router logits (``output_router_logits=True``): TRL's test of an MoE model
    with an auxiliary loss."""
    return hasattr(_text_config(model), "output_router_logits")


def router_loss(model: torch.nn.Module, coef: float | None) -> RouterLoss | None:
    """``loss.router_aux_loss_coef`` (``coef``) for ``model``, as TRL 1.16 resolves it: null takes the model config's
    ``router_aux_loss_coef`` (0 where it declares none); None when no loss is added (a dense model, or a
    coefficient of 0). A non-zero coefficient for a model without router logits is a ConfigError."""
    config = _text_config(model)
    if coef and not returns_router_logits(model):
        raise ConfigError(
            f"loss.router_aux_loss_coef: {coef} is set, but {type(inner_model(model)).__name__} is not a "
            "Mixture-of-Experts model that returns its router logits, so there is no load-balancing loss to weight "
            "(DeepSeek-V3 and GLM-4-MoE balance experts with a routing bias, not a loss); set it to null or 0")
    resolved = (getattr(config, "router_aux_loss_coef", None) or 0.0) if coef is None else coef
    if not returns_router_logits(model) or not resolved:
        return None
    return RouterLoss(coef=float(resolved), top_k=int(config.num_experts_per_tok))


def router_logits_off(model: torch.nn.Module) -> None:
    """Keep ``output_router_logits`` off in ``model``'s config (a checkpoint saved by a trainer may have it on):
    with it on, every forward computes transformers' own auxiliary loss over the attention mask it was given, which
    does not line up with the routed tokens when a forward reads a KV cache (generation, the shared prompt pass):
    a shape error. grpo asks for the router logits per forward where it adds the loss (``grpo.step.logprobs``)."""
    config = _text_config(model)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
