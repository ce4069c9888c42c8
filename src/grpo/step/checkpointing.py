"""Gradient checkpointing around the log-prob passes (``grpo.step.logprobs``): paused for a pass without gradients
(nothing to recompute), and taken over for the shared prompt pass under gradients.

Hugging Face drops the KV cache of a checkpointing layer in training, because the backward's recompute would run
the layer's cache update a second time. Here the completion pass reads its prompt's cache through read-only layers
(``update`` returns prompt + new keys without storing them), so a recompute sees exactly what the first run saw,
and each decoder layer that checkpoints is checkpointed by grpo instead (``torch.utils.checkpoint``, non-reentrant:
gradients reach the prompt's keys and values through the cache, which a reentrant checkpoint would not follow).
The prompt pass itself runs uncheckpointed: it holds the activations of the group's one prompt, not of G copies.
TRL's default ``gradient_checkpointing=True`` otherwise costs the G-fold prompt compute the sharing saves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel


class ReadOnlyLayer(DynamicLayer):
    """A prompt's cached keys and values that a forward reads but never extends."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def read_only(cache) -> bool:
    """Turn each of ``cache``'s layers read-only in place; False (cache untouched) when one is not a plain
    ``DynamicLayer`` (sliding-window and other kinds keep state of their own)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return False
    for layer in layers:
        layer.__class__ = ReadOnlyLayer  # same attributes; only update() differs
    return True


def checkpointing_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules with gradient checkpointing on: Hugging Face keeps the switch as a boolean
    ``gradient_checkpointing`` attribute on the base model and on each ``GradientCheckpointingLayer``."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextmanager
def checkpointing_paused(model: torch.nn.Module) -> Iterator[None]:
    """Gradient checkpointing off on every module of ``model`` that has it, for a pass that needs no
    gradients (nothing to recompute, and the prompt's KV cache can then be kept). Train/eval mode is
    left alone, so dropout behaves as in the pass it replaces. The exact previous state is restored on
    exit, exceptions included (an instance attribute set back; one the module only inherited, removed)."""
    paused = [(m, "gradient_checkpointing" in vars(m)) for m in checkpointing_modules(model)]
    try:
        for module, _ in paused:
            module.gradient_checkpointing = False
        yield
    finally:
        for module, own_attribute in paused:
            if own_attribute:
                module.gradient_checkpointing = True
            else:
                del module.gradient_checkpointing


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers that checkpoint (``gradient_checkpointing`` on, as ``every_n_layers`` left it)."""
    return [m for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False) is True]


def can_checkpoint_with_prefix(model: torch.nn.Module) -> bool:
    """Whether every module with checkpointing on is a Hugging Face decoder layer (which grpo can checkpoint
    itself) or a model whose flag only marks the switch; another kind checkpoints in a way grpo cannot take over."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    return bool(checkpointed_layers(model)) and all(
        isinstance(m, (GradientCheckpointingLayer, PreTrainedModel)) for m in flagged)


@contextmanager
def grpo_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """While open, Hugging Face's checkpointing is off on every module that has it, and each checkpointing
    decoder layer's forward runs under a non-reentrant ``torch.utils.checkpoint`` instead, its cache argument
    kept. Everything is restored on exit, exceptions included."""
    layers = checkpointed_layers(model)
    with checkpointing_paused(model):
        for layer in layers:
            layer.forward = _checkpointed(layer)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward


def _checkpointed(layer: torch.nn.Module):
    """``layer``'s forward under a non-reentrant checkpoint. Hugging Face's own checkpointing is paused around
    each run of it, the backward's recompute included, which comes after ``grpo_checkpointing`` has restored it."""
    forward = type(layer).forward.__get__(layer)

    def plain_forward(*args, **kwargs):
        with checkpointing_paused(layer):
            return forward(*args, **kwargs)

    def run(*args, **kwargs):
        return checkpoint(plain_forward, *args, use_reentrant=False, **kwargs)
    return run
