"""Policy weights published through the filesystem, from the trainer (rank 0) to sampler processes.

Layout, under a run's ``output_dir``::

    weights/LATEST                  the newest published version number (text, replaced atomically)
    weights/v{N}/model.safetensors  full model weights, or only the LoRA adapter tensors
    weights/v{N}/adapter_config.json  the LoRA config (kind "lora" only)
    weights/v{N}/manifest.json      written last: {format, version, kind, files: {name: {sha256, bytes}}, created}
    weights/leases/v{N}.{reader}    a read lease: empty, made by a reader before it reads v{N}, removed after;
                                    {reader} is host-pid-random, so every lease has a name of its own

A version folder is written into a hidden sibling (``.tmp-v{N}-{pid}``), every file and the folder
fsynced, then renamed into place, so a reader never sees a half-written ``v{N}``; a folder without
``manifest.json`` is not a version. ``load`` checks every file's size and SHA-256 against the manifest
before parsing it, so a torn or corrupt file raises ``WeightStoreError`` instead of giving partial
weights. Only safetensors and JSON are read: nothing from another process is unpickled.

Versions are plain ints (a folder name is never taken from a message or a file), published in
increasing order by one writer. After a publish the newest ``keep`` versions remain, and any older one
a reader holds a lease on that is younger than the store's ``lease_timeout_s`` (600 s): readers may be
on other hosts over NFS, where a file removed while it is read gives a stale-handle error (ESTALE). An
older lease is removed with its version (its reader was killed); a released version goes with the next
publish. To prune, the writer looks at the leases, renames the unleased versions to
``.prune-v{N}-{pid}``, looks again and puts back any leased meanwhile; a reader takes its lease, then
reads the manifest: either the writer sees the lease or the reader sees the version gone. Leases use
only what NFS does safely: creating a uniquely named file, unlinking it, and its mtime (no ``flock``,
no rename over a file others read).

A read that meets a vanished file or ESTALE anyway is tried again (``read_tries``, short growing
pauses, the manifest read again each time); a version that is gone for good raises
``VersionPrunedError`` (a ``WeightStoreError`` naming the version and folder), and a reader loads the
newest instead (``load_newest``). Publishing version N also removes any version > N, leased or not:
those belong to an abandoned run (a trainer resumed from an earlier checkpoint re-publishes from
there), and a sampler must not mistake them for newer weights.

The code: ``layout`` (file names, ``LoadedWeights``, ``WeightStoreError``, ``VersionPrunedError``),
``store`` (``WeightStore``: publish, find and load versions), ``leases`` (read leases), ``files``
(hashing, fsync, JSON, retries of stale reads), ``apply`` (models to state dicts and back).
"""

from grpo.weight_store.apply import apply_to_model, state_dict_for_publish
from grpo.weight_store.layout import (
    ADAPTER_CONFIG_FILE,
    KINDS,
    LATEST_FILE,
    LEASES_DIR,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MODEL_FILE,
    WEIGHTS_DIR,
    Kind,
    LoadedWeights,
    VersionPrunedError,
    WeightStoreError,
)
from grpo.weight_store.store import WeightStore

__all__ = [
    "ADAPTER_CONFIG_FILE", "KINDS", "LATEST_FILE", "LEASES_DIR", "MANIFEST_FILE", "MANIFEST_FORMAT", "MODEL_FILE",
    "WEIGHTS_DIR", "Kind", "LoadedWeights", "VersionPrunedError", "WeightStore", "WeightStoreError", "apply_to_model",
    "state_dict_for_publish",
]
