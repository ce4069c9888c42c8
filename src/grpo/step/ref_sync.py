"""TR-DPO's moving reference (TRL's ``sync_ref_model``, ``SyncRefModelCallback``): every ``loss.ref_sync_steps``
steps, once the step's update is done, each reference parameter becomes ``alpha * policy + (1 - alpha) *
reference`` (``loss.ref_mixup_alpha``). The next step's reference log-probs, and the evaluations after it, are then
the moved reference's. Its weights change, so checkpoints keep them (``reference/``) for a resume to continue them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from grpo.compat import save_pretrained
from grpo.run.checkpoint import load_weights

REFERENCE_DIR = "reference"  # in a checkpoint folder, when the reference moves


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``reference <- alpha * policy + (1 - alpha) * reference``, parameter by parameter in place, in the
    reference's dtype, as TRL's ``_sync_target_model`` computes it. The reference is a copy of the policy (the same
    parameters in the same order) or, under LoRA, of its base: its weights are then mixed toward the policy's
    effective ones (``effective_weight``)."""
    if not isinstance(policy, PeftModel):
        for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
            ref_param.mul_(1.0 - alpha).add_(param, alpha=alpha)
        return
    model = policy.get_base_model()
    for name, ref_param in reference.named_parameters():
        ref_param.mul_(1.0 - alpha).add_(effective_weight(model, name).to(ref_param.dtype), alpha=alpha)


def effective_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter ``name`` (as a model without adapters names it) of the LoRA-injected ``model`` as the forward
    pass applies it: a LoRA layer's base weight plus its active adapters' delta (``scale x B @ A``, peft's
    ``get_delta_weight``), any other parameter as it is."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    if not isinstance(module, LoraLayer):
        return model.get_parameter(name)
    weight = module.get_base_layer().get_parameter(leaf)
    if leaf != "weight" or module.merged:
        return weight
    return weight + sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)


@dataclass
class RefSync:
    """The reference moved toward ``policy`` every ``every`` steps by ``alpha``; called with each finished step."""

    reference: torch.nn.Module
    policy: torch.nn.Module
    alpha: float
    every: int

    def __call__(self, step: int) -> bool:
        """Move the reference after ``step``'s update when it is a sync step; returns whether it moved."""
        if step % self.every:
            return False
        mix_into_reference(self.reference, self.policy, self.alpha)
        return True


def save_reference(checkpoint: Path, reference: torch.nn.Module) -> None:
    """The moved reference's weights into ``checkpoint/reference/`` (HF format)."""
    save_pretrained(reference, checkpoint / REFERENCE_DIR)


def load_saved_reference(checkpoint: Path, reference: torch.nn.Module) -> bool:
    """The reference of ``checkpoint`` into ``reference`` in place; False (the reference untouched: the initial
    weights, which a run that never moved it still has) when the checkpoint holds none."""
    folder = checkpoint / REFERENCE_DIR
    if not folder.is_dir():
        return False
    load_weights(folder, reference)
    return True
