"""The ``fsdp`` section of the config tree (``grpo.config.schema``): how PyTorch's FSDP2 (``fully_shard``) shards
the trainer ranks' policy when ``train.fsdp`` is on (``grpo.parallel.fsdp`` reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import opt


@dataclass
class FsdpConfig:
    layer_classes: list[str] = opt(
        [], "Module classes that are each one FSDP2 unit (gathered, then freed, one at a time); [] = the model's "
        "own _no_split_modules (Qwen2DecoderLayer, LlamaDecoderLayer, ...). The rest (embeddings, final norm, "
        "LM head) is the root unit.")
    reduce_dtype: str = opt(
        "float32", "Gradients are reduced across ranks in this dtype under model.bf16 (parameters are gathered "
        "in bf16 from fp32 shards): float32 (exact sums) or bfloat16 (half the traffic).",
        choices=("float32", "bfloat16"))
    cpu_offload: bool = opt(
        False, "Keep each rank's parameter, gradient and optimizer-state shards in CPU memory (the optimizer "
        "steps there); units are copied to the device to be gathered.")
    reshard_after_forward: bool = opt(
        True, "Free each unit's gathered parameters after its forward and gather them again for backward "
        "(ZeRO-3); false keeps them from forward to backward (ZeRO-2: more memory, one gather fewer).")
    accumulate_unsharded: bool = opt(
        False, "Gradient accumulation without resharding between an update's micro-batches: the gathered "
        "parameters and full gradients stay until its last backward, which alone reduce-scatters (fewer "
        "collectives, DDP's memory for parameters and gradients); false reduce-scatters every micro-batch.")
