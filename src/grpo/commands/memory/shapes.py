"""A decoder-only model's shape (from its ``config.json``) and the parameter counts that follow from it.

The shape is read from a local checkpoint folder, from the Hugging Face cache (offline), or from a
small built-in table of Qwen2.5 architectures (numbers from their public ``config.json`` files), so
that ``grpo memory`` works without the weights and without network access. The sizes drive the activation
formulas; the parameters are counted from the sizes for a Llama/Qwen2-style decoder (exact there), and for any
other family transformers knows on its own model class (``grpo.commands.memory.counts``: extra norms, fused
projections, experts, latent attention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from grpo.commands.memory.counts import ArchitectureCounts, LayerTraits, architecture_counts
from grpo.config import ConfigError

# The linear layers of one Llama/Qwen2-style decoder layer; ``all-linear`` LoRA targets all of them.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Families whose parameters the Llama-style formula counts exactly (the others are counted on their model class).
LLAMA_STYLE = ("qwen2", "llama", "mistral")


def _qwen25(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
            tied: bool) -> dict:
    return {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "vocab_size": vocab, "tie_word_embeddings": tied}


# Public config.json values of Qwen2.5 (base and -Instruct share them). 7B has its own vocabulary
# size (152064) and untied embeddings; the smaller ones tie the LM head to the embeddings.
_QWEN25 = {
    "0.5B": _qwen25(896, 24, 14, 2, 4864, 151936, True),    # 0.49B parameters
    "1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, True),   # 1.54B
    "3B": _qwen25(2048, 36, 16, 2, 11008, 151936, True),    # 3.09B
    "7B": _qwen25(3584, 28, 28, 4, 18944, 152064, False),   # 7.62B
}
# The two models the scale page (docs/guides/scale.md) sizes, from their public config.json files: a 30B MoE with
# 3B active (48 layers of 128 experts, 8 routed per token) and a 70B dense Llama.
_QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
                  "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                  "router_aux_loss_coef": 0.001}
_LLAMA31_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
                "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
BUILTIN_CONFIGS: dict[str, dict] = {
    **{f"Qwen/Qwen2.5-{size}{suffix}": config for size, config in _QWEN25.items() for suffix in ("", "-Instruct")},
    "Qwen/Qwen3-30B-A3B": _QWEN3_30B_A3B,
    **{f"meta-llama/Llama-3.1-70B{suffix}": _LLAMA31_70B for suffix in ("", "-Instruct")},
}


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: sizes of one Llama/Qwen2-style decoder (GQA attention, gated MLP, RMSNorm)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has biases on q/k/v
    mlp_bias: bool = False
    counts: ArchitectureCounts | None = None  # counted on the model class (families other than LLAMA_STYLE)

    @classmethod
    def from_config(cls, config: dict, source: str) -> ModelShape:
        """Read a ``config.json`` dict; a missing size is an error naming ``source``."""
        config = config.get("text_config", config)  # multimodal wrappers keep the decoder here
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if not isinstance(config.get(k), int)]
        if missing:
            raise ConfigError(f"{source}: config.json lacks {', '.join(missing)}; grpo memory needs a "
                              "decoder-only transformer config (Llama/Qwen2 style)")
        heads = config["num_attention_heads"]
        counts = None if config.get("model_type", "llama") in LLAMA_STYLE else architecture_counts(config)
        return cls(
            hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            mlp_bias=bool(config.get("mlp_bias", False)), counts=counts)

    @property
    def traits(self) -> LayerTraits:
        """What the layers keep beyond a Llama/Qwen2 layer's (read off the model class; Llama-style: nothing)."""
        return self.counts.traits if self.counts else LayerTraits()

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_names(self) -> tuple[str, ...]:
        """The names of one decoder layer's linear layers (what ``model.lora_target_modules`` can list)."""
        return self.counts.linear_names() if self.counts else LINEAR_NAMES

    def largest_tensor_params(self) -> int:
        """The largest single parameter tensor (the embedding, an MLP projection, an MoE layer's experts)."""
        if self.counts:
            return self.counts.largest_tensor
        return max(self.embedding_params(), self.intermediate_size * self.hidden_size)

    def longest_linear_side(self, names: tuple[str, ...]) -> int:
        """The longest side of the named linears (a LoRA factor's length is one side)."""
        if self.counts:
            return max(max(a, b) for name, a, b in self.counts.linears if name in names)
        shapes = self.linear_shapes()
        return max(max(shapes[name]) for name in names)

    def linear_params(self) -> int:
        """Weights of the decoder layers' linears, all layers (what 4-bit quantisation and autocast's
        weight cache cover; embeddings, norms and the LM head are outside them; an MoE's routed experts too)."""
        if self.counts:
            return sum(a * b for _, a, b in self.counts.linears)
        return self.num_layers * sum(a * b for a, b in self.linear_shapes().values())

    def layer_params(self) -> int:
        """Parameters of one decoder layer (linears, their biases, two RMSNorm weights); counted on the model class,
        the largest layer (an MoE layer's experts and router included)."""
        if self.counts:
            return self.counts.largest_layer
        shapes = self.linear_shapes()
        weights = sum(a * b for a, b in shapes.values())
        bias = sum(shapes[n][1] for n in ("q_proj", "k_proj", "v_proj")) if self.attention_bias else 0
        if self.mlp_bias:
            bias += sum(shapes[n][1] for n in ("gate_proj", "up_proj", "down_proj"))
        return weights + bias + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.counts.embedding if self.counts else self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """All parameters: embeddings, layers, final norm, and the LM head unless tied."""
        if self.counts:
            return self.counts.total
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size + head

    def root_params(self) -> int:
        """What is outside the decoder layers: embeddings, final norm, an untied LM head (FSDP2's root unit)."""
        if self.counts:
            return self.counts.total - self.counts.layers_total
        return self.num_params() - self.num_layers * self.layer_params()

    def largest_module_params(self) -> int:
        """The most parameters one module holds at once (what ZeRO-3 gathers to compute it)."""
        return max(self.embedding_params(), self.layer_params())


def lora_targets(target_modules: str | list[str], shape: ModelShape | None = None) -> tuple[str, ...]:
    """``model.lora_target_modules`` as linear names: ``all-linear`` = all of ``shape``'s (peft leaves out the LM
    head; no shape: a Llama-style decoder's seven)."""
    known = shape.linear_names() if shape is not None else LINEAR_NAMES
    if target_modules == "all-linear":
        return known
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"model.lora_target_modules: grpo memory knows the linears {list(known)} "
                          f"(or 'all-linear'); cannot size {unknown}")
    return tuple(n for n in known if n in names)


def lora_params(shape: ModelShape, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: r x (in + out) per targeted linear (A is r x in, B is out x r), every layer."""
    if shape.counts:
        return sum(r * (a + b) for name, a, b in shape.counts.linears if name in targets)
    shapes = shape.linear_shapes()
    return shape.num_layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in targets)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") != 1


def load_model_config(name_or_path: str, key: str) -> tuple[dict, str]:
    """(config.json dict, where it came from) for a local folder, a cached hub id, or a built-in architecture.

    Raises ConfigError naming ``key`` when none has it (no network is used).
    """
    folder = Path(name_or_path).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()), f"{folder / 'config.json'}"
    if folder.exists() or _looks_local(name_or_path):
        raise ConfigError(f"{key}: {name_or_path!r} has no config.json (a local checkpoint folder or a hub id "
                          "org/name is expected)")
    try:
        cached = try_to_load_from_cache(name_or_path, "config.json")
    except ValueError:  # not a valid repo id (HFValidationError): then not in the cache either
        cached = None
    if isinstance(cached, str) and Path(cached).is_file():
        return json.loads(Path(cached).read_text()), f"{cached} (Hugging Face cache)"
    if name_or_path in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[name_or_path], "built-in table"
    raise ConfigError(f"{key}: no config.json for {name_or_path!r}: not a local folder, not in the Hugging Face "
                      f"cache, and not a built-in architecture ({', '.join(sorted(BUILTIN_CONFIGS))}); point it "
                      "at a local checkpoint folder")
