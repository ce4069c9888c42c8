"""TR-DPO's moving reference (TRL's ``sync_ref_model``, ``SyncRefModelCallback``): every ``loss.ref_sync_steps``
steps, once the step's update is done, each reference parameter becomes ``alpha * policy + (1 - alpha) *
reference`` (``loss.ref_mixup_alpha``). The next step's reference log-probs, and the evaluations after it, are then
the moved reference's. Its weights change, so checkpoints keep them (``reference/``) for a resume to continue them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.compat import save_pretrained
from grpo.run.checkpoint import load_weights

REFERENCE_DIR = "reference"  # in a checkpoint folder, when the reference moves


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``reference <- alpha * policy + (1 - alpha) * reference``, parameter by parameter in place (the reference is
    a copy of the policy: the same parameters in the same order), in the reference's dtype, as TRL's
    ``_sync_target_model`` computes it."""
    for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
        ref_param.mul_(1.0 - alpha).add_(param, alpha=alpha)


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
