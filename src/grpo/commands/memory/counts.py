"""Parameter counts read off a model's own architecture: transformers builds the model class of a ``config.json``
on the meta device (no memory, no weights, no network) and its parameters are counted where they are.

Why: ``grpo.commands.memory.shapes.ModelShape`` counts a Llama/Qwen2-style decoder from its sizes, which is exact
for those, but other families add parameters that formula does not know: Qwen3's and OLMo 2's query/key norms,
Gemma 3's and GLM-4's extra layer norms, Phi-3's fused projections (the same count, other names), an MoE's routed
and shared experts and router, DeepSeek-V3's multi-head latent attention, GPT-OSS's attention sinks and biases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass(frozen=True)
class ArchitectureCounts:
    """What memory depends on, counted on the model itself.

    total: every parameter (a tied LM head once); embedding: the input embedding's; largest_layer: the most any
    one decoder layer holds; largest_tensor: the largest parameter (an MoE layer's experts are one); linears: ``(name, in_features, out_features)`` of every linear layer of the decoder
    layers, every layer (the LM head is not one: peft's ``all-linear`` leaves it out too); layers_total: the decoder
    layers' parameters together (DeepSeek-V3's first layers are dense, the rest MoE: not num_layers x the largest).
    """

    total: int
    embedding: int
    largest_layer: int
    largest_tensor: int
    linears: tuple[tuple[str, int, int], ...]
    layers_total: int = 0

    def linear_names(self) -> tuple[str, ...]:
        """The distinct names ``model.lora_target_modules`` can list, sorted."""
        return tuple(sorted({name for name, _, _ in self.linears}))


def architecture_counts(config: dict) -> ArchitectureCounts | None:
    """The counts of ``config``'s model class, or None when transformers does not know its ``model_type`` (a
    model with remote code: the caller keeps its own formula)."""
    return _counts(json.dumps(config, sort_keys=True))


@lru_cache(maxsize=16)
def _counts(config_json: str) -> ArchitectureCounts | None:
    values = json.loads(config_json)
    model_type = values.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except ValueError:  # an unknown model_type
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    linears = tuple((name.rsplit(".", 1)[-1], module.in_features, module.out_features)
                    for layer in layers for name, module in layer.named_modules()
                    if isinstance(module, torch.nn.Linear) and module is not head)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return ArchitectureCounts(
        total=sum(p.numel() for p in model.parameters()),
        embedding=model.get_input_embeddings().weight.numel(),
        largest_layer=max(per_layer, default=0),
        largest_tensor=max(p.numel() for p in model.parameters()), linears=linears, layers_total=sum(per_layer))
