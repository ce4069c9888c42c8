"""The map from a causal LM's final hidden states to the logits its forward returns, for the fused LM head
(``grpo.algorithm.head``, which applies it a chunk of positions at a time).

It is the LM head module, then what some families do to its output: Gemma 2/3 soft-cap the logits
(``final_logit_softcapping``), Cohere multiplies them by ``logit_scale``, Granite divides them by
``logits_scaling``. The head alone gave those models log-probs off by up to 0.2 nats, with nothing to say so.
A forward that does anything else is found by one probe forward per model (``head_reproduces_forward``),
and the log-prob passes keep the model's own logits for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from grpo.models.wrappers import decoder, inner_model, output_head

# model -> whether logits_head reproduces its forward: probed once per model object (weights change what
# the logits are, never what the forward does to them)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _text_config(model: torch.nn.Module):
    config = inner_model(model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logits_head(model: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """``[..., H] -> [..., V]``: the model's LM head (LoRA on it, tied weights and autocast as in its forward),
    then the logit scaling or soft-capping its config names."""
    head = output_head(model)
    config = _text_config(model)
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    divisor = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(logits / cap)

    def apply(hidden: Tensor) -> Tensor:
        logits = head(hidden)
        if isinstance(scale, (int, float)):
            logits = logits * scale
        if isinstance(divisor, (int, float)):
            logits = logits / divisor
        if isinstance(cap, (int, float)) and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


def head_reproduces_forward(model: torch.nn.Module) -> bool:
    """Whether ``logits_head(model)`` of the final hidden states equals the logits the model's forward returns,
    on a two-token probe without gradient (its dropout off for it); once per model object."""
    inner = inner_model(model)
    if inner in _PROBED:
        return _PROBED[inner]
    ids = torch.tensor([[1, 2]], device=next(inner.parameters()).device)  # within any vocabulary
    captured: list[Tensor] = []
    handle = decoder(inner).register_forward_hook(lambda _module, _args, output: captured.append(output[0]))
    training = inner.training
    try:
        inner.eval()
        with torch.no_grad():
            logits = inner(input_ids=ids, use_cache=False).logits.float()
            ours = logits_head(inner)(captured[-1]).float()
    finally:
        handle.remove()
        inner.train(training)
    same = ours.shape == logits.shape and torch.allclose(ours, logits, rtol=1e-2, atol=1e-2)
    _PROBED[inner] = same
    return same
