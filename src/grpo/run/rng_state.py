"""The RNG states a checkpoint saves (Python, numpy, torch CPU and CUDA), as tensors and plain lists, so
``torch.load(weights_only=True)`` can read them back without unpickling objects."""

from __future__ import annotations

import random
import warnings
from typing import Any

# numpy is always present (matplotlib and datasets require it), so its RNG state is always saved.
import numpy as np
import torch


def capture_rng() -> dict:
    """Python, numpy, torch CPU and CUDA RNG states as tensors and plain lists (weights_only-safe)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    np_state = np.random.get_state(legacy=False)
    state["numpy"] = {
        "bit_generator": np_state["bit_generator"],
        "key": [int(x) for x in np_state["state"]["key"]],  # uint32 array -> ints: no numpy pickles
        "pos": int(np_state["state"]["pos"]),
        "has_gauss": int(np_state["has_gauss"]),
        "gauss": float(np_state["gauss"]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Any) -> None:
    """Set every RNG from ``capture_rng``'s dict; ValueError when ``state`` is not such a dict."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        torch.set_rng_state(state["torch"])
        saved_np = dict(state["numpy"])  # back to the get_state(legacy=False) layout
        saved_np["state"] = {"key": np.array(saved_np.pop("key"), dtype=np.uint32), "pos": saved_np.pop("pos")}
        np.random.set_state(saved_np)
        if "cuda" in state:
            _restore_cuda_rng(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from err


def _restore_cuda_rng(states: list[torch.Tensor]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count != len(states):  # allowed (e.g. inspecting a GPU run on CPU), but sampling will differ
        warnings.warn(f"the checkpoint holds CUDA RNG states for {len(states)} device(s) but {count} are "
                      "visible; restoring the overlapping ones only", stacklevel=3)
    for index in range(min(count, len(states))):
        torch.cuda.set_rng_state(states[index], device=index)
