"""A no-grad copy of the policy for sampling: the base architecture in the sampling dtype, LoRA merged.

Why a copy: on a GPU, sampling over the trained fp32 weights under autocast re-casts every weight to
bf16 for every decode token, and a LoRA policy pays two extra small matmuls per adapted layer per token
(or, folded through ``functional_call``, a re-dispatch of the whole module tree: 3.3x slower on an H100).
The copy holds each weight once, already in bf16, with the adapter merged in (``W + B A * scale`` computed
in the policy's precision, rounded once). ``refresh()`` rewrites it in place from the policy: one read of
the policy's weights and one write of the copy's (milliseconds on a GPU), so the engine refreshes before
every generation and can never sample from stale weights.

Cost: one more copy of the weights in the sampling dtype (3 GB for a 1.5B model in bf16); ``grpo memory``
counts it for ``rollout.engine: hf-static``.
"""

from __future__ import annotations

import copy

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor

from grpo.models.embeddings import keep_head_fp32
from grpo.models.wrappers import unwrap_model


def _base_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a DDP wrapper and a peft wrapper (with its LoRA layers still inside)."""
    model = unwrap_model(policy)
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def _set_submodule(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


class SamplingCopy:
    """``model``: the plain transformers model (no peft layers) in ``dtype`` on the policy's device.

    Args:
        policy: the trained model (plain, peft LoRA, or DDP-wrapped); it is read, never modified.
        dtype: the copy's dtype (bf16 on a GPU; the policy's own dtype keeps sampling exact on a CPU).
    """

    def __init__(self, policy: torch.nn.Module, dtype: torch.dtype):
        self.policy, self.dtype = policy, dtype
        base = _base_model(policy)
        lora_names = [name for name, module in base.named_modules() if isinstance(module, LoraLayer)]
        for name in lora_names:
            weight = getattr(base.get_submodule(name).base_layer, "weight", None)
            if weight is None or not weight.is_floating_point():
                raise ValueError(f"rollout engine hf-static: the LoRA layer {name!r} wraps a packed/quantized "
                                 "weight (QLoRA), which a sampling copy cannot merge; use rollout.engine: hf")
        # Deep-copy the structure once, then swap every LoRA wrapper for its base layer: the copy is the
        # plain architecture (its own buffers, e.g. rotary frequencies, come along) with no adapters.
        model = copy.deepcopy(base)
        for name in lora_names:
            _set_submodule(model, name, model.get_submodule(name).base_layer)
        model.requires_grad_(False)
        model.eval()
        self.model = model.to(dtype)
        keep_head_fp32(self.model)  # model.lm_head_fp32: the policy's head is float32, so the sampler's is
        # (destination parameter, source weight, LoRA layer or None), matched by module name once.
        self._pairs: list[tuple[Tensor, Tensor, torch.nn.Module | None]] = []
        copy_params = dict(self.model.named_parameters())
        sources: dict[str, tuple[Tensor, torch.nn.Module | None]] = {}
        for name in lora_names:
            layer = base.get_submodule(name)
            for pname, param in layer.base_layer.named_parameters(recurse=False):
                sources[f"{name}.{pname}"] = (param, layer if pname == "weight" else None)
        for pname, param in base.named_parameters():
            if "lora_" in pname or ".base_layer." in pname:
                continue
            sources.setdefault(pname, (param, None))
        missing = sorted(set(copy_params) - set(sources))
        if missing:
            raise RuntimeError(f"sampling copy: no source weight for {missing[:5]} (an unknown adapter layout?)")
        for pname, destination in copy_params.items():
            source, layer = sources[pname]
            self._pairs.append((destination, source, layer))
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy's current weights (adapters merged) into the sampling copy, in place."""
        for destination, source, layer in self._pairs:
            if layer is None:
                destination.copy_(source)
                continue
            merged = source
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:  # peft's own delta: B @ A * scaling (fan_in_fan_out handled there)
                    merged = merged + layer.get_delta_weight(adapter).to(source.dtype)
            destination.copy_(merged)

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
