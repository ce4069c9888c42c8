"""State dicts against a model's own: which keys name one tensor (tied embeddings), and which keys are
missing or unexpected once that is allowed for. Shared by checkpoint loading and the weight store."""

from __future__ import annotations

from collections import defaultdict

import torch


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """Identity of a tensor's memory (None for empty tensors, which cannot alias anything)."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def tied_aliases(own: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """For each state-dict key, the other keys naming the same tensor (tied embeddings)."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for key, tensor in own.items():
        if (storage := storage_key(tensor)) is not None:
            groups[storage].append(key)
    return {key: set(group) - {key} for group in groups.values() for key in group}


def unmatched_keys(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys of ``state`` against the model's ``own`` state dict, sorted.

    A tied weight is saved once, so its key counts as present when an alias of it is present."""
    aliases = tied_aliases(own)
    unexpected = sorted(set(state) - set(own))
    missing = sorted(k for k in set(own) - set(state) if not aliases.get(k, set()) & set(state))
    return missing, unexpected
