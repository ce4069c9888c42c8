"""Build ``assets/tiny-moe``: the shipped tiny-math model upcycled into a Mixture-of-Experts one (Qwen2-MoE), CPU.

Sparse upcycling (Komatsuzaki et al., 2022): every decoder layer's dense MLP becomes ``--experts`` experts that
start as copies of it, of which a router picks ``--top-k`` per token (their weights renormalised, so that any
choice of identical experts gives the dense MLP's output); attention, norms, embeddings and the tokenizer are
tiny-math's. Qwen2-MoE is Qwen2 with MoE layers (the same attention, biases included), plus a shared expert,
which starts at zero here (its down projection zeroed) so that the upcycled model computes what tiny-math
computes, up to the bf16 the weights are stored in. The routers start small and random: which experts a token
gets is arbitrary at first, and the experts drift apart as GRPO trains them on the tokens routed to each, which
is where routing replay matters (``configs/moe-demo-cpu.yaml``).

    python scripts/build_tiny_moe_model.py                  # a few seconds; writes assets/tiny-moe
    python scripts/build_tiny_moe_model.py --experts 8 --top-k 2 --out /tmp/tiny-moe
Deterministic from ``--seed``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]


def upcycle(dense, experts: int, top_k: int, seed: int, shared: int = 8) -> Qwen2MoeForCausalLM:
    """The Qwen2-MoE whose experts are copies of ``dense``'s (a Qwen2ForCausalLM) MLPs."""
    c = dense.config
    config = Qwen2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings, hidden_act=c.hidden_act,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=c.intermediate_size,
        norm_topk_prob=True, shared_expert_intermediate_size=shared, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, use_sliding_window=False)
    torch.manual_seed(seed)
    moe = Qwen2MoeForCausalLM(config)
    dense_state = dense.state_dict()
    with torch.no_grad():
        for name, tensor in moe.state_dict().items():
            if name in dense_state:  # embeddings, attention, norms
                tensor.copy_(dense_state[name])
        for layer, block in zip(dense.model.layers, moe.model.layers):
            mlp, sparse = layer.mlp, block.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2 I, H], as Qwen2MoeExperts splits it
            sparse.experts.gate_up_proj.copy_(gate_up.expand(experts, -1, -1))
            sparse.experts.down_proj.copy_(mlp.down_proj.weight.expand(experts, -1, -1))
            torch.nn.init.normal_(sparse.gate.weight, std=0.02)
            sparse.shared_expert.down_proj.weight.zero_()  # the shared expert adds nothing at first
    moe.generation_config = dense.generation_config
    return moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=str(REPO_ROOT / "assets" / "tiny-math"))
    parser.add_argument("--out", default=str(REPO_ROOT / "assets" / "tiny-moe"))
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dense = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    moe = upcycle(dense, args.experts, args.top_k, args.seed).eval()
    ids = torch.randint(3, dense.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():  # the upcycled model computes what the dense one does
        gap = (moe(input_ids=ids).logits - dense(input_ids=ids).logits).abs().max().item()
    if gap > 1e-4:
        raise SystemExit(f"the upcycled model's logits differ from {args.base}'s by {gap}")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    moe.to(torch.bfloat16).save_pretrained(out)  # bf16 on disk: half the size; loaded back in float32
    AutoTokenizer.from_pretrained(args.base).save_pretrained(out)
    params = sum(p.numel() for p in moe.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters ({args.experts} experts of {dense.config.intermediate_size}, "
          f"top {args.top_k}); logits within {gap:.1e} of {args.base}'s")


if __name__ == "__main__":
    main()
