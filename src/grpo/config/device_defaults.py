"""Config values whose default depends on the device, resolved where the run knows its device: which engine
``rollout.engine: auto`` (the default) runs, and what the log-prob passes' null settings mean
(``PassDefaults``). Pure and torch-free, so ``grpo memory`` counts what a run on that device builds.
The measurements behind each value: docs/device-choices.md."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

AUTO = "auto"  # rollout.engine: the device's engine (resolve_engine_name); tool_call_format: the template's


def resolve_engine_name(name: str, device_type: str, *, quantized: bool = False, full_attention: bool = True,
                        sharded: bool = False) -> str:
    """The engine ``rollout.engine: name`` runs on a ``device_type`` device. ``auto`` is ``hf-static`` on CUDA:
    on an H200 (Qwen2.5-1.5B shape, 128 rows x 256 tokens, inside training) it sampled in 1.75 s against HF
    ``generate``'s 8.05 s (LoRA: 1.64 vs 13.45 s); ``hf`` elsewhere, where it is the faster (it drops
    finished rows, which a fixed-shape graph cannot), and where hf-static cannot run: a 4-bit base (no
    sampling copy can merge LoRA into packed weights), a model with other than full-attention layers, or
    weights sharded by ZeRO-3 or FSDP2 (a sampling copy of a shard is not the model, and one of the whole model,
    held for the run, would undo the sharding)."""
    if name != AUTO:
        return name
    return "hf-static" if device_type == "cuda" and not (quantized or sharded) and full_attention else "hf"


@dataclass(frozen=True)
class PassDefaults:
    """What the log-prob passes' null (or ``auto``) settings mean on one device type. None of them changes a
    value or a gradient beyond float re-association; they change how fast a pass runs and its peak."""

    share_prompts: bool  # train.shared_prompt_pass null: each distinct prompt runs once per micro-batch
    column_bucket: int  # train.column_bucket null: run widths rounded up to a multiple of this
    # train.fused_lm_head null: fused when a micro-batch's logits would reach this many elements, in a pass
    # with gradients (its logits and their gradient live through backward) and in a no-grad pass (transient)
    fused_head_min_elements: int
    fused_head_min_elements_no_grad: int
    token_budget: bool  # train.max_tokens_per_micro_batch auto: cut by padded tokens (else micro_batch_size rows)


# On a CPU compute is the cost: sharing prompts and cutting micro-batches by tokens save it, padding columns
# only add to it, and the fused head was faster (and smaller) from 2^26 logits (256 MB in float32). On CUDA
# the host's dispatch and new shapes are the cost: the plain pass (about 0.6x the operators), fixed-row
# micro-batches and bucketed widths repeat shapes; the fused head keeps the update's logits small, but its
# chunks slowed the no-grad passes, whose logits are transient, until those are large (2^30 elements: 4 GiB
# in float32). Measured on an H200: docs/device-choices.md.
PASS_DEFAULTS: Mapping[str, PassDefaults] = MappingProxyType({
    "cpu": PassDefaults(share_prompts=True, column_bucket=1, fused_head_min_elements=2 ** 26,
                        fused_head_min_elements_no_grad=2 ** 26, token_budget=True),
    "cuda": PassDefaults(share_prompts=False, column_bucket=64, fused_head_min_elements=2 ** 26,
                         fused_head_min_elements_no_grad=2 ** 30, token_budget=False),
})


def pass_defaults(device_type: str) -> PassDefaults:
    """The log-prob passes' defaults on a ``device_type`` device; types not listed take the CPU's."""
    return PASS_DEFAULTS.get(device_type, PASS_DEFAULTS["cpu"])


def fused_head_by_size(setting: bool | None, *, rows: int, positions: int, vocab_size: int, device_type: str,
                       grad: bool) -> bool:
    """Whether ``train.fused_lm_head`` (``setting``) fuses a micro-batch of ``rows`` x ``positions`` scored
    positions: as set, or (None) when its logits would reach the device type's size for the pass."""
    if setting is not None:
        return setting
    defaults = pass_defaults(device_type)
    return rows * positions * vocab_size >= (defaults.fused_head_min_elements if grad
                                             else defaults.fused_head_min_elements_no_grad)
