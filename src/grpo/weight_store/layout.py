"""What a published weights version is: the file names under ``weights/``, the manifest format, the
parsed version (``LoadedWeights``) and the errors for one that is missing, torn, corrupt or pruned."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

WEIGHTS_DIR = "weights"
LATEST_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
LEASES_DIR = "leases"
MANIFEST_FORMAT = "grpo-weights/1"
KINDS = ("full", "lora")

_VERSION_DIR = re.compile(r"^v(\d+)$")
# ".tmp-v{N}-{pid}" (being written), ".old-v{N}-{pid}" (being replaced), ".prune-v{N}-{pid}" (being pruned)
_TEMP_DIR = re.compile(r"^\.(?P<kind>tmp|old|prune)-(?P<name>v\d+)-\d+$")

Kind = Literal["full", "lora"]


class WeightStoreError(RuntimeError):
    """A published version is missing, torn, corrupt, or does not fit the model it is loaded into."""


class VersionPrunedError(WeightStoreError):
    """The version was pruned by the writer while it was being read: a newer one is (or will be) published."""


@dataclass(frozen=True)
class LoadedWeights:
    """One published version, verified and parsed.

    version:        the version number.
    kind:           "full" (every weight of the causal LM, tied duplicates left out) or "lora"
                    (the adapter tensors only, keys as ``peft.get_peft_model_state_dict`` names them).
    state_dict:     name -> CPU tensor, dtypes as published.
    adapter_config: the LoRA config as a dict (kind "lora"), else None.
    """

    version: int
    kind: Kind
    state_dict: dict[str, torch.Tensor]
    adapter_config: dict[str, Any] | None


def _check_version(version: Any) -> int:
    """A version is a non-negative int (not a bool, not a string): folder names come only from it."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"a weights version must be a non-negative int, got {version!r}")
    return version
