"""What a run changes on a model's input and output embeddings: the LM head computed in float32 (TRL's
``cast_lm_head_to_fp32``, ScaleRL's and MiniMax-M1's fix for the trainer's and sampler's log-probs drifting apart
in bf16) and NEFTune's noise on the input embeddings (transformers' ``neftune_noise_alpha``).

Both act on the model object in place, so every pass through it sees them: the log-prob passes (plain logits and the
fused head, which calls the same head module), the hf engine's sampling, the reference. A copy of the model made
afterwards (the reference of a full fine-tune, hf-static's sampling copy) carries the fp32 head along; one cast to
another dtype afterwards gets it back with ``keep_head_fp32``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers.integrations.neftune import activate_neftune

from grpo.errors import ConfigError
from grpo.models.wrappers import inner_model, output_head

FP32_MARK = "_grpo_head_fp32"  # set on a head module whose forward runs in float32


def _fp32_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The head's linear map in float32 whatever the autocast around it: [..., H] -> [..., V] float32."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(hidden.float(), self.weight.float(), bias)


def head_in_fp32(model: torch.nn.Module) -> None:
    """``model``'s LM head in float32, weights and matmul (TRL's ``cast_lm_head_to_fp32``): its weights cast to
    float32 once (a tied input embedding then is float32 too, and its outputs are cast back to the model's dtype, as
    TRL does), its forward a float32 linear map outside autocast. A ConfigError for a head that carries a LoRA
    adapter (``model.lora_target_modules`` naming it), as TRL refuses it."""
    head = output_head(model)
    if isinstance(head, BaseTunerLayer):
        raise ConfigError("model.lm_head_fp32: the LM head carries a LoRA adapter (model.lora_target_modules names "
                          "it); leave the head out of the adapter or set model.lm_head_fp32: false (TRL refuses this "
                          "too)")
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"model.lm_head_fp32: the LM head is a {type(head).__name__}, not a linear layer; set "
                          "model.lm_head_fp32: false")
    inner = inner_model(model)
    embeddings = inner.get_input_embeddings()
    tied = embeddings.weight is head.weight
    dtype = head.weight.dtype
    head.float()
    head.forward = types.MethodType(_fp32_forward, head)  # deep copies rebind it to the copied head
    setattr(head, FP32_MARK, True)
    if tied and dtype != torch.float32:  # the embeddings are float32 now: their outputs stay the model's dtype
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def keep_head_fp32(model: torch.nn.Module) -> None:
    """After ``model.to(dtype)`` of a model whose head ``head_in_fp32`` made float32 (a copy of it): its head's
    weights back in float32."""
    head = output_head(model)
    if getattr(head, FP32_MARK, False):
        head.float()


def add_neftune(model: torch.nn.Module, alpha: float) -> None:
    """NEFTune as transformers' Trainer adds it: uniform noise of scale alpha / sqrt(L x H) on the input embeddings'
    output whenever the embeddings module is in training mode (transformers' ``activate_neftune``): the
    policy's log-prob and update passes; not the samplers' generation (grpo's engines switch the model to eval
    mode) nor the frozen reference."""
    activate_neftune(model, alpha)  # transformers' own (the embeddings of a peft model's base too)
