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
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from safetensors import SafetensorError

WEIGHTS_DIR = "weights"
LATEST_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
MANIFEST_FORMAT = "grpo-weights/1"
KINDS = ("full", "lora")

_VERSION_DIR = re.compile(r"^v(\d+)$")
_TEMP_DIR = re.compile(r"^\.(?P<kind>tmp|old)-(?P<name>v\d+)-\d+$")  # ".tmp-v{N}-{pid}", ".old-v{N}-{pid}"
_HASH_CHUNK = 1 << 20

Kind = Literal["full", "lora"]


class WeightStoreError(RuntimeError):
    """A published version is missing, torn, corrupt, or does not fit the model it is loaded into."""


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


class WeightStore:
    """Versioned weights under ``root/weights/`` (``root`` is the run's output_dir); see the module docstring.

    One process publishes (the trainer's rank 0); any number of processes load.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.dir = self.root / WEIGHTS_DIR

    def version_dir(self, version: int) -> Path:
        """``weights/v{version}`` (whether or not it exists)."""
        return self.dir / f"v{_check_version(version)}"

    # ------------------------------------------------------------ publishing

    def publish(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor],
        *,
        kind: Kind,
        adapter_config: dict[str, Any] | None = None,
        keep: int = 2,
    ) -> Path:
        """Write ``weights/v{version}/`` atomically, point ``LATEST`` at it, prune older versions.

        Args:
            state_dict: name -> tensor (any device); written as contiguous CPU tensors. Tensors must
                not share memory (``state_dict_for_publish`` drops tied duplicates).
            kind: "full" or "lora" (then ``state_dict`` holds only the adapter tensors).
            adapter_config: the LoRA config as a JSON-compatible dict; required for "lora", refused for "full".
            keep: how many versions to keep, the new one included (>= 1; 2 lets a sampler finish
                reading the previous one while the next is written).
        Returns the version folder. On failure the previous versions and ``LATEST`` are untouched
        and no ``v{version}`` is left behind.
        """
        _check_version(version)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if kind == "lora" and not isinstance(adapter_config, dict):
            raise ValueError("kind='lora' needs adapter_config (the LoRA config as a dict)")
        if kind == "full" and adapter_config is not None:
            raise ValueError("adapter_config is only for kind='lora'")
        # Everything that can fail on bad input fails before the disk is touched.
        tensors = _tensors_for_saving(state_dict)
        config_json = None if adapter_config is None else json.dumps(_json_safe(adapter_config), indent=2)

        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        final = self.version_dir(version)
        tmp = self.dir / f".tmp-v{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            safetensors.torch.save_file(tensors, tmp / MODEL_FILE, metadata={"format": "pt"})
            if config_json is not None:
                (tmp / ADAPTER_CONFIG_FILE).write_text(config_json, encoding="utf-8")
            files = {}
            for name in sorted(p.name for p in tmp.iterdir()):
                _fsync_file(tmp / name)
                files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
            manifest = {"format": MANIFEST_FORMAT, "version": version, "kind": kind, "files": files,
                        "created": time.time()}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")  # last
            _fsync_file(tmp / MANIFEST_FILE)
            _fsync_dir(tmp)
            self._move_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # ignore_errors: never hide the real error
            raise
        _fsync_dir(self.dir)
        self._write_latest(version)
        self._prune(just_written=version, keep=keep)
        return final

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """``os.replace`` the folder; a version re-published (after a resume) replaces the old one."""
        if not final.exists():
            os.replace(tmp, final)
            return
        old = self.dir / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(old, final)  # put the previous copy back before reporting the failure
            raise
        shutil.rmtree(old, ignore_errors=True)

    def _write_latest(self, version: int) -> None:
        tmp = self.dir / f".{LATEST_FILE}-{os.getpid()}"
        try:
            tmp.write_text(f"{version}\n", encoding="utf-8")
            _fsync_file(tmp)
            os.replace(tmp, self.dir / LATEST_FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.dir)

    def _prune(self, just_written: int, keep: int) -> None:
        """Keep the newest ``keep`` versions <= ``just_written`` (it included); drop newer ones (abandoned)."""
        versions = self.versions()
        abandoned = [v for v in versions if v > just_written]
        older = [v for v in versions if v < just_written]
        for v in abandoned + older[:max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)

    def _remove_stale_temps(self) -> None:
        """Leftovers of a publish that was killed (there is one writer, so none is in progress)."""
        for entry in self.dir.iterdir():
            if entry.name.startswith(f".{LATEST_FILE}-") and entry.is_file():
                entry.unlink(missing_ok=True)  # a LATEST update killed before its rename
                continue
            if not ((match := _TEMP_DIR.match(entry.name)) and entry.is_dir()):
                continue
            original = self.dir / match["name"]
            if match["kind"] == "old" and not original.exists():
                os.replace(entry, original)  # killed between the two renames of a re-publish: put it back
            else:
                shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------ finding versions

    def versions(self) -> list[int]:
        """Every complete version (a ``v{N}`` folder with a manifest), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(match.group(1)) for entry in self.dir.iterdir()
                      if (match := _VERSION_DIR.match(entry.name)) and (entry / MANIFEST_FILE).is_file())

    def latest_version(self) -> int | None:
        """The version ``LATEST`` names when that version is complete; else the newest complete one; else None."""
        try:
            text = (self.dir / LATEST_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            text = ""
        if text.isascii() and text.isdigit() and (self.version_dir(int(text)) / MANIFEST_FILE).is_file():
            return int(text)
        found = self.versions()
        return found[-1] if found else None

    def wait_for_version(self, min_version: int, timeout_s: float = 600.0, poll_s: float = 0.5) -> int:
        """Block until a version >= ``min_version`` is published; return the latest one.

        Raises TimeoutError after ``timeout_s`` seconds naming the folder and the latest version seen.
        """
        _check_version(min_version)
        if timeout_s < 0 or poll_s <= 0:
            raise ValueError(f"need timeout_s >= 0 and poll_s > 0, got {timeout_s}, {poll_s}")
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest_version()
            if latest is not None and latest >= min_version:
                return latest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no weights version >= {min_version} was published in {self.dir} within "
                                   f"{timeout_s:g} s (latest: {latest}); is the trainer running and publishing?")
            time.sleep(min(poll_s, remaining))

    # ------------------------------------------------------------ loading

    def load(self, version: int, verify: bool = True) -> LoadedWeights:
        """Read version ``version``; with ``verify`` every file's size and SHA-256 must match the manifest.

        Raises WeightStoreError naming the file when the version is missing, torn or corrupt, or when a
        file changed or vanished while it was read (re-published or pruned meanwhile: load the latest again).
        """
        folder = self.version_dir(version)
        manifest = self._read_manifest(folder, version)
        kind, files = manifest["kind"], manifest["files"]
        if MODEL_FILE not in files or (kind == "lora") != (ADAPTER_CONFIG_FILE in files):
            raise WeightStoreError(f"{folder / MANIFEST_FILE} lists {sorted(files)}, which does not fit kind {kind!r}")
        # A file replaced after it was hashed (the version re-published meanwhile) must not pass as verified.
        stats = {name: _stat(folder / name) for name in files}
        if verify:
            for name, entry in files.items():
                _verify_file(folder / name, entry, stats[name])
        adapter_config = None
        if kind == "lora":
            adapter_config = _read_json(folder / ADAPTER_CONFIG_FILE)
            if not isinstance(adapter_config, dict):
                raise WeightStoreError(f"{folder / ADAPTER_CONFIG_FILE} does not hold a JSON object")
        try:
            state_dict = safetensors.torch.load_file(folder / MODEL_FILE, device="cpu")
        except (SafetensorError, OSError) as err:
            raise WeightStoreError(f"{folder / MODEL_FILE} cannot be read ({err}); the version is torn or "
                                   "corrupt") from err
        for name in files:
            if _stat(folder / name) != stats[name]:
                raise WeightStoreError(f"{folder / name} changed while it was being read (version {version} "
                                       "re-published?); load it again")
        return LoadedWeights(version=version, kind=kind, state_dict=state_dict, adapter_config=adapter_config)

    def _read_manifest(self, folder: Path, version: int) -> dict[str, Any]:
        path = folder / MANIFEST_FILE
        if not path.is_file():
            raise WeightStoreError(f"weights version {version} is not published in {self.dir} "
                                   f"({path} is missing); published: {self.versions()}")
        manifest = _read_json(path)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if (not isinstance(files, dict) or manifest.get("version") != version or manifest.get("kind") not in KINDS
                or manifest.get("format") != MANIFEST_FORMAT):
            raise WeightStoreError(f"{path} is not a {MANIFEST_FORMAT} manifest for version {version}")
        for name, entry in files.items():
            # Names come from the file: only plain names of this format, never a path out of the folder.
            if name not in (MODEL_FILE, ADAPTER_CONFIG_FILE):
                raise WeightStoreError(f"{path} lists an unexpected file {name!r}")
            if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                    or isinstance(entry.get("bytes"), bool) or not isinstance(entry.get("bytes"), int)):
                raise WeightStoreError(f"{path}: entry for {name!r} needs sha256 (str) and bytes (int)")
        return manifest


# ---------------------------------------------------------------- models <-> state dicts


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel  # imported here: peft takes seconds to import

    return isinstance(model, PeftModel)


def state_dict_for_publish(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], Kind, dict[str, Any] | None]:
    """``(state_dict, kind, adapter_config)`` to pass to ``WeightStore.publish``.

    A DDP wrapper is unwrapped. A peft model gives its adapter tensors (``get_peft_model_state_dict``)
    and its active LoRA config as a JSON-compatible dict; any other model gives its full state dict
    with tied duplicates (e.g. ``lm_head.weight`` tied to the embeddings) left out, the first name of
    each group kept. Tensors are detached, contiguous and on the CPU; CPU tensors may share memory with
    the model's parameters, so publish them before the next optimizer step.
    """
    model = _unwrap(model)
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
        adapter_config: dict[str, Any] | None = _json_safe(model.peft_config[model.active_adapter].to_dict())
        kind: Kind = "lora"
    else:
        state = model.state_dict()
        seen: set[tuple] = set()
        deduplicated = {}
        for name, tensor in state.items():
            key = _storage_key(tensor)
            if key is not None and key in seen:
                continue  # a tied alias of a tensor already kept
            if key is not None:
                seen.add(key)
            deduplicated[name] = tensor
        state, adapter_config, kind = deduplicated, None, "full"
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}, kind, adapter_config


def apply_to_model(model: torch.nn.Module, loaded: LoadedWeights) -> None:
    """Load ``loaded`` into ``model`` in place (values copied into the existing parameters: their
    device and dtype stay).

    "full": strict (every weight present, no extra key; a tied alias such as ``lm_head.weight`` may be
    absent when the tensor it is tied to is present) into a causal LM that is not a peft model.
    "lora": the adapter tensors into a peft model with the same adapter keys and the same r / alpha.
    Raises WeightStoreError saying what does not match.
    """
    model = _unwrap(model)
    where = f"weights version {loaded.version} ({loaded.kind})"
    if loaded.kind == "lora":
        if not _is_peft(model):
            raise WeightStoreError(f"{where} holds a LoRA adapter, but the model is not a peft model")
        _apply_adapter(model, loaded, where)
    elif loaded.kind == "full":
        if _is_peft(model):
            raise WeightStoreError(f"{where} holds full model weights, but the model is a peft model")
        _apply_full(model, loaded, where)
    else:
        raise WeightStoreError(f"{where}: unknown kind {loaded.kind!r}; expected one of {KINDS}")


def _apply_full(model: torch.nn.Module, loaded: LoadedWeights, where: str) -> None:
    own = model.state_dict()
    state = loaded.state_dict
    aliases = _tied_aliases(own)
    unexpected = sorted(set(state) - set(own))
    missing = sorted(k for k in set(own) - set(state) if not aliases.get(k, set()) & set(state))
    if missing or unexpected:
        raise WeightStoreError(f"{where} does not match the model ({len(missing)} missing, e.g. {missing[:3]}; "
                               f"{len(unexpected)} unexpected, e.g. {unexpected[:3]})")
    wrong_shape = [k for k in state if tuple(state[k].shape) != tuple(own[k].shape)]
    if wrong_shape:
        k = wrong_shape[0]
        raise WeightStoreError(f"{where} does not fit the model: {len(wrong_shape)} shape mismatches, e.g. {k} "
                               f"{tuple(state[k].shape)} vs {tuple(own[k].shape)}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # strictness checked above, tied aliases allowed


def _apply_adapter(model: torch.nn.Module, loaded: LoadedWeights, where: str) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    own_config = model.peft_config[model.active_adapter].to_dict()
    published = loaded.adapter_config or {}
    for key in ("r", "lora_alpha", "use_rslora"):  # a different scaling would load silently otherwise
        if key in published and published[key] != own_config.get(key):
            raise WeightStoreError(f"{where}: adapter {key}={published[key]!r} but the model's is "
                                   f"{own_config.get(key)!r}")
    own = get_peft_model_state_dict(model)
    missing, unexpected = sorted(set(own) - set(loaded.state_dict)), sorted(set(loaded.state_dict) - set(own))
    if missing or unexpected:
        raise WeightStoreError(f"{where}: adapter does not match the model (missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}); was it published with another LoRA config?")
    wrong_shape = [k for k in own if tuple(own[k].shape) != tuple(loaded.state_dict[k].shape)]
    if wrong_shape:
        k = wrong_shape[0]
        raise WeightStoreError(f"{where}: adapter does not fit the model, e.g. {k} "
                               f"{tuple(loaded.state_dict[k].shape)} vs {tuple(own[k].shape)}")
    with torch.no_grad():
        set_peft_model_state_dict(model, loaded.state_dict)


# ---------------------------------------------------------------- helpers


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    """Identity of a tensor's memory (None for empty tensors, which cannot alias anything)."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _tied_aliases(own: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """For each state-dict key, the other keys naming the same tensor (tied embeddings)."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for key, tensor in own.items():
        if (storage := _storage_key(tensor)) is not None:
            groups[storage].append(key)
    return {key: set(group) - {key} for group in groups.values() for key in group}


def _tensors_for_saving(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous, detached CPU tensors; refuses non-tensors and tensors that share memory (safetensors
    stores each tensor once, so an alias must be dropped by the caller, who knows which name is canonical)."""
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError("state_dict must be a non-empty dict of name -> tensor")
    tensors: dict[str, torch.Tensor] = {}
    owners: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict entries must be str -> Tensor; got {name!r} -> {type(tensor).__name__}")
        if tensor.numel() > 0:  # checked on the caller's tensors: a copy to the CPU would hide a GPU alias
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
            if storage in owners:
                raise ValueError(f"state_dict entries {owners[storage]!r} and {name!r} share memory (tied "
                                 "weights?); publish one of them (state_dict_for_publish drops tied duplicates)")
            owners[storage] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


def _json_safe(value: Any) -> Any:
    """A peft config dict as JSON: sets -> sorted lists, enums -> their values, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return _json_safe(value.value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"adapter_config holds a {type(value).__name__} ({value!r}), which JSON cannot store")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WeightStoreError(f"{path} cannot be read ({err}); the version is torn or corrupt") from err


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError as err:
        raise WeightStoreError(f"{path} is missing ({err}); the version is torn or was pruned") from err
    return st.st_ino, st.st_size, st.st_mtime_ns


def _verify_file(path: Path, entry: dict[str, Any], stat: tuple[int, int, int]) -> None:
    size = stat[1]
    if size != entry["bytes"]:
        raise WeightStoreError(f"{path} has {size} bytes but the manifest says {entry['bytes']}; the file is torn")
    try:
        digest = _sha256(path)
    except OSError as err:
        raise WeightStoreError(f"{path} cannot be read ({err})") from err
    if digest != entry["sha256"]:
        raise WeightStoreError(f"{path} does not match its SHA-256 in the manifest; the file is corrupt")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, a rename) durable; only possible on POSIX."""
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
