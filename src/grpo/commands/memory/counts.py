"""Parameter counts read off a model's own architecture: transformers builds the model class of a ``config.json``
on the meta device (no memory, no weights, no network) and its parameters are counted where they are.

Why: ``grpo.commands.memory.shapes.ModelShape`` counts a Llama/Qwen2-style decoder from its sizes, which is exact
for those, but other families add parameters that formula does not know: Qwen3's and OLMo 2's query/key norms,
Gemma 3's and GLM-4's extra layer norms, Phi-3's fused projections (the same count, other names), an MoE's routed
and shared experts and router, DeepSeek-V3's multi-head latent attention, GPT-OSS's attention sinks and biases.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass(frozen=True)
class LayerTraits:
    """What a family's decoder layers keep for backward beyond a Llama/Qwen2 layer's, read off its modules (the
    activation formulas' inputs): RMSNorms over the hidden width (Gemma 3's and GLM-4's post-norms: 4), per-head
    or full-width query/key norms (Qwen3, OLMo 2, Gemma 3), a fused qkv projection whose v is a view of the whole
    output (Phi-3), an attention output that o_proj keeps as a copy of its own, and the routed experts of an MoE's layers: how many layers have them, E, k and each expert's
    width, the shared experts' width, the dense MLP width of the other layers."""

    hidden_norms: int = 2
    qk_norm: bool = False
    fused_qkv: bool = False
    attention_output_copied: bool = False
    latent_attention: tuple[int, int, int, int, int] | None = None  # MLA: q/kv LoRA ranks, nope/rope/v head dims
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0
    shared_width: int = 0
    dense_width: int = 0
    # ((module, bytes per value, trains), bytes kept per input element): the family's own hidden norm, q/k norm and
    # router measured on a CPU copy (measure_kept)
    kept: tuple[tuple[tuple[str, int, bool], float], ...] = ()

    def kept_per_element(self, module: str, p: int, trains: bool) -> float:
        """Bytes ``module`` ("norm", "qk_norm") keeps per element of its input, in a ``p``-byte dtype; not measured:
        a Llama RMSNorm's fp32 input, and its normalised value when the weight trains."""
        return dict(self.kept).get((module, p, trains), 4 + (p if trains else 0))

    def router_bytes(self, p: int, trains: bool, hidden: int) -> float:
        """Bytes the router keeps per token; not measured: fp32 probabilities over the E experts."""
        measured = dict(self.kept).get(("router", p, trains))
        return 4 * self.experts if measured is None else measured * hidden


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
    traits: LayerTraits = LayerTraits()

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
        largest_tensor=max(p.numel() for p in model.parameters()), linears=linears, layers_total=sum(per_layer),
        traits=layer_traits(config, layers))


QK_NORMS = ("q_norm", "k_norm")
MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")  # DeepSeek-V3's latent projections' norms (not the hidden width)
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "experts_per_token")


def layer_traits(config, layers: list[torch.nn.Module]) -> LayerTraits:
    """``LayerTraits`` of these decoder layers (built on the meta device), the norms and projections of the first,
    the experts of the first MoE layer."""
    h = config.hidden_size
    first = dict(layers[0].named_modules()) if layers else {}
    norms = [name for name, m in first.items() if "Norm" in type(m).__name__ and name]
    hidden_norms = sum(1 for name in norms if name.rsplit(".", 1)[-1] not in QK_NORMS + MLA_NORMS
                       and getattr(first[name], "weight", None) is not None and first[name].weight.numel() == h)
    routed = [_routed_experts(layer) for layer in layers]
    moe = [layer for layer, experts in zip(layers, routed) if experts is not None]
    dense = [layer for layer, experts in zip(layers, routed) if experts is None]
    experts = next((e for e in routed if e is not None), None)
    E = width = 0
    if experts is not None:
        weights = dict(experts.named_parameters())
        weight = weights.get("down_proj", next(p for p in weights.values() if p.dim() == 3))
        E, sides = weight.shape[0], [d for d in weight.shape[1:] if d != h]
        width = sides[0] if sides else h
    fused_qkv = any(name.endswith("qkv_proj") for name in first)
    rope = getattr(config, "rope_parameters", None) or {}
    partial = min(getattr(config, "partial_rotary_factor", None) or 1.0,
                  rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
    # q/k concatenated from parts (partial rotary), sliced from a fused qkv, or an eager pass with attention sinks
    # leave attention's output heads-first: the transpose before o_proj copies it (MLA's formula counts its own)
    copied = fused_qkv or partial < 1.0 or any(
        name.endswith("sinks") for name, _ in layers[0].named_parameters()) if layers else False
    hidden = next((first[name] for name in norms if name.rsplit(".", 1)[-1] not in QK_NORMS + MLA_NORMS), None)
    qk = next((first[name] for name in norms if name.rsplit(".", 1)[-1] in QK_NORMS), None)
    router = next((m for m in moe[0].modules() if "Router" in type(m).__name__), None) if moe else None
    kept = tuple(((label, p, trains), measure_kept(module, width, dtype, trains, with_input=label != "router"))
                 for label, module, width in (("norm", hidden, h), ("qk_norm", qk, qk.weight.numel() if qk else 0),
                                              ("router", router, h)) if module is not None
                 for p, dtype in ((4, torch.float32), (2, torch.bfloat16)) for trains in (True, False))
    return LayerTraits(
        kept=kept, hidden_norms=hidden_norms or 2, qk_norm=any(name.rsplit(".", 1)[-1] in QK_NORMS for name in norms),
        fused_qkv=fused_qkv, attention_output_copied=copied, latent_attention=_latent_ranks(config),
        moe_layers=len(moe), experts=E,
        experts_per_token=next((getattr(config, k) for k in TOP_K_KEYS if getattr(config, k, None)), 0) if moe else 0,
        expert_width=width, shared_width=_mlp_width(moe[0], shared=True) if moe else 0,
        dense_width=_mlp_width(dense[0], shared=False) if dense else 0)


def measure_kept(module: torch.nn.Module, width: int, dtype: torch.dtype, trains: bool, with_input: bool,
                 tokens: int = 8) -> float:
    """Bytes ``module`` keeps for backward per element of a [tokens, width] input that needs a gradient, on a CPU
    copy of it in ``dtype`` (its parameters training or frozen), the input's own storage counted when
    ``with_input`` (a norm's input is the residual stream, which nothing else keeps; a router's is the normed
    state the layer's linears keep already): a family's norm
    keeps its normalised value in fp32 (OLMo 2, Gemma 3) or a router an fp32 copy of its input (ERNIE, DeepSeek-V3)
    whatever the formula of a Llama layer says."""
    copy_ = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in list(copy_.parameters()) + list(copy_.buffers()):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02 if tensor.is_floating_point()
                         else torch.zeros_like(tensor))
    copy_.requires_grad_(trains)
    x = torch.randn(tokens, width, generator=generator).to(dtype).requires_grad_()
    skip = {p.untyped_storage().data_ptr() for p in copy_.parameters()}
    if not with_input:
        skip.add(x.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        copy_(x)
    return sum(saved.values()) / (tokens * width)


def _latent_ranks(config) -> tuple[int, int, int, int, int] | None:
    """DeepSeek-V3's multi-head latent attention sizes (q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim), or None for another attention."""
    if not getattr(config, "kv_lora_rank", None):
        return None
    return (getattr(config, "q_lora_rank", None) or 0, config.kv_lora_rank, config.qk_nope_head_dim,
            config.qk_rope_head_dim, config.v_head_dim)


def _routed_experts(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's routed experts (a module holding 3-D expert weights, not a shared expert), or None."""
    for name, module in layer.named_modules():
        if name.endswith("experts") and "shared" not in name and any(p.dim() == 3 for p in module.parameters()):
            return module
    return None


def _mlp_width(layer: torch.nn.Module, shared: bool) -> int:
    """The gated MLP width of ``layer``: its shared experts' (``shared``) or its dense MLP's."""
    width = 0
    for name, module in layer.named_modules():
        if not isinstance(module, torch.nn.Linear) or ("shared" in name) != shared or "mlp" not in name:
            continue
        if name.endswith("gate_proj"):
            width += module.out_features
        elif name.endswith("gate_up_proj"):
            width += module.out_features // 2
    return width
