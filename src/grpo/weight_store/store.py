"""``WeightStore``: versioned weights under a run's ``weights/`` folder, published atomically by one writer
and loaded, verified, by any number of readers (the layout is described in ``grpo.weight_store``)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from grpo.run.durable import replace_dir, settle_leftover
from grpo.weight_store.files import (
    _fsync_dir,
    _fsync_file,
    _json_safe,
    _read_json,
    _sha256,
    _stat,
    _verify_file,
)
from grpo.weight_store.layout import (
    _TEMP_DIR,
    _VERSION_DIR,
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
    _check_version,
)


class WeightStore:
    """Versioned weights under ``root/weights/`` (``root`` is the run's output_dir); see ``grpo.weight_store``.

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
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # ignore_errors: never hide the real error
            raise
        _fsync_dir(self.dir)
        self._write_latest(version)
        self._prune(just_written=version, keep=keep)
        return final

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
            settle_leftover(entry, match["kind"], self.dir / match["name"])

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
