"""What the memory tests measure a pass by (tests/test_memory.py's activation formulas, the architecture matrix's
per-family gap)."""

from __future__ import annotations

import torch


def saved_bytes(model, forward) -> int:
    """Bytes of every tensor autograd keeps for backward while ``forward()`` runs, storages counted once, the
    parameters left out."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(n for ptr, n in saved.items() if ptr not in params)
