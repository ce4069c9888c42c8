"""Config values whose default depends on the device, resolved where the run knows its device: which engine
``rollout.engine: auto`` (the default) runs. Pure and torch-free, so ``grpo memory`` counts the engine a run
builds. (The log-prob passes' device defaults are ``grpo.step.logprobs.DEVICE_DEFAULTS``.)"""

from __future__ import annotations

AUTO = "auto"  # rollout.engine's default: the device's engine (resolve_engine_name)


def resolve_engine_name(name: str, device_type: str, *, quantized: bool = False, full_attention: bool = True,
                        sharded: bool = False) -> str:
    """The engine ``rollout.engine: name`` runs on a ``device_type`` device. ``auto`` is ``hf-static`` on CUDA:
    on an H200 (Qwen2.5-1.5B shape, 128 rows x 256 tokens, inside training) it sampled in 1.75 s against HF
    ``generate``'s 8.05 s (LoRA: 1.64 vs 13.45 s); ``hf`` elsewhere, where it is the faster (it drops
    finished rows, which a fixed-shape graph cannot), and where hf-static cannot run: a 4-bit base (no
    sampling copy can merge LoRA into packed weights), a model with other than full-attention layers, or
    weights sharded by ZeRO-3 (a sampling copy of a shard is not the model)."""
    if name != AUTO:
        return name
    return "hf-static" if device_type == "cuda" and not (quantized or sharded) and full_attention else "hf"
