"""Policy weights published through the filesystem, from the trainer (rank 0) to sampler processes.

Layout, under a run's ``output_dir``::

    weights/LATEST                  the newest published version number (text, replaced atomically)
    weights/v{N}/model.safetensors  full model weights, or only the LoRA adapter tensors
    weights/v{N}/adapter_config.json  the LoRA config (kind "lora" only)
    weights/v{N}/manifest.json      written last: {format, version, kind, files: {name: {sha256, bytes}}, created}

A version folder is written into a hidden sibling (``.tmp-v{N}-{pid}``), every file and the folder
fsynced, then renamed into place, so a reader never sees a half-written ``v{N}``; a folder without
``manifest.json`` is not a version. ``load`` checks every file's size and SHA-256 against the manifest
before parsing it, so a torn or corrupt file raises ``WeightStoreError`` instead of giving partial
weights. Only safetensors and JSON are read: nothing from another process is unpickled.

Versions are plain ints (a folder name is never taken from a message or a file), published in
increasing order by one writer. After a publish only the newest ``keep`` versions remain, so a sampler
still reading the previous one is not pulled from under it (with ``keep >= 2``). Publishing version N
also removes any version > N: those belong to an abandoned run (a trainer resumed from an earlier
checkpoint re-publishes from there), and a sampler must not mistake them for newer weights.

The code: ``layout`` (file names, ``LoadedWeights``, ``WeightStoreError``), ``store`` (``WeightStore``:
publish, find and load versions), ``files`` (hashing, fsync, JSON), ``apply`` (models to state dicts
and back).
"""

from grpo.weight_store.apply import apply_to_model, state_dict_for_publish
from grpo.weight_store.layout import (
    ADAPTER_CONFIG_FILE,
    KINDS,
    LATEST_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MODEL_FILE,
    WEIGHTS_DIR,
    Kind,
    LoadedWeights,
    WeightStoreError,
)
from grpo.weight_store.store import WeightStore

__all__ = [
    "ADAPTER_CONFIG_FILE", "KINDS", "LATEST_FILE", "MANIFEST_FILE", "MANIFEST_FORMAT", "MODEL_FILE", "WEIGHTS_DIR",
    "Kind", "LoadedWeights", "WeightStore", "WeightStoreError", "apply_to_model", "state_dict_for_publish",
]
