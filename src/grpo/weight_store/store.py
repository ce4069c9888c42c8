"""``WeightStore``: versioned weights under a run's ``weights/`` folder, published atomically by one writer
and loaded, verified, by any number of readers (the layout is described in ``grpo.weight_store``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from grpo.run.durable import replace_dir, settle_leftover
from grpo.weight_store.files import (
    FileVanishedError,
    _fsync_dir,
    _fsync_file,
    _json_safe,
    _read_json,
    _read_tensors,
    _retry_stale,
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
    LEASES_DIR,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MODEL_FILE,
    WEIGHTS_DIR,
    Kind,
    LoadedWeights,
    VersionPrunedError,
    WeightStoreError,
    _check_version,
)
from grpo.weight_store.leases import held_versions, read_lease
from grpo.weight_store.streamed import TensorStream, write_stream


class WeightStore:
    """Versioned weights under ``root/weights/`` (``root`` is the run's output_dir); see ``grpo.weight_store``.

    One process publishes (the trainer's rank 0); any number of processes load, possibly on other hosts
    over NFS.

    Args:
        lease_timeout_s: (the writer) a read lease older than this no longer keeps its version from being
            pruned, so a reader killed with ``kill -9`` cannot pin one forever. Make it longer than the
            slowest load plus the clock skew between hosts (a lease's age is the writer's clock minus
            the file server's mtime).
        read_tries, retry_pause_s: (readers) how often a read that meets a vanished file or a stale NFS
            handle is tried, pausing ``retry_pause_s`` seconds, doubled after each try.
    """

    def __init__(self, root: str | os.PathLike, *, lease_timeout_s: float = 600.0, read_tries: int = 4,
                 retry_pause_s: float = 0.05) -> None:
        valid_tries = isinstance(read_tries, int) and not isinstance(read_tries, bool) and read_tries >= 1
        if not (lease_timeout_s > 0 and valid_tries and retry_pause_s >= 0):
            raise ValueError(f"need lease_timeout_s > 0, an int read_tries >= 1 and retry_pause_s >= 0; got "
                             f"{lease_timeout_s!r}, {read_tries!r}, {retry_pause_s!r}")
        self.root = Path(root)
        self.dir = self.root / WEIGHTS_DIR
        self.lease_timeout_s = lease_timeout_s
        self.read_tries = read_tries
        self.retry_pause_s = retry_pause_s

    def version_dir(self, version: int) -> Path:
        """``weights/v{version}`` (whether or not it exists)."""
        return self.dir / f"v{_check_version(version)}"

    # ------------------------------------------------------------ publishing

    def publish(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor] | TensorStream,
        *,
        kind: Kind,
        adapter_config: dict[str, Any] | None = None,
        keep: int = 2,
    ) -> Path:
        """Write ``weights/v{version}/`` atomically, point ``LATEST`` at it, prune older versions.

        Args:
            state_dict: name -> tensor (any device); written as contiguous CPU tensors. Tensors must
                not share memory (``state_dict_for_publish`` drops tied duplicates). Or a ``TensorStream``:
                tensors written one at a time as they come (gathered from shards one at a time).
            kind: "full" or "lora" (then ``state_dict`` holds only the adapter tensors).
            adapter_config: the LoRA config as a JSON-compatible dict; required for "lora", refused for "full".
            keep: how many versions to keep, the new one included (>= 1). Older versions a reader holds
                a fresh lease on are kept as well, and pruned by a later publish once released.
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
        # Everything that can fail on bad input fails before the disk is touched (a stream: its layout).
        if isinstance(state_dict, TensorStream):
            if not state_dict.layout:
                raise ValueError("the tensor stream's layout is empty")
            write_model = partial(write_stream, stream=state_dict)
        else:
            write_model = partial(_save_file, _tensors_for_saving(state_dict))
        config_json = None if adapter_config is None else json.dumps(_json_safe(adapter_config), indent=2)

        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        final = self.version_dir(version)
        tmp = self.dir / f".tmp-v{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write_model(tmp / MODEL_FILE)
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
        """Keep the newest ``keep`` versions <= ``just_written`` (it included) and the older ones a reader
        holds; drop newer ones (abandoned: no lease keeps them, they must not be served)."""
        versions = self.versions()
        abandoned = [v for v in versions if v > just_written]
        older = [v for v in versions if v < just_written]
        for v in abandoned:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)
        self._prune_unleased(older[:max(len(older) - (keep - 1), 0)])

    def _prune_unleased(self, candidates: list[int]) -> None:
        """Remove the candidates no reader holds a fresh lease on.

        A reader takes its lease, then checks that the version exists; the writer hides a version
        (rename), then reads the leases again and puts back one that was leased meanwhile. So either
        the writer sees the lease or the reader sees the version gone: it is never removed under a
        reader who found it (that reader may see it missing for a moment, and reads it again).
        """
        leases = self.dir / LEASES_DIR
        held = held_versions(leases, self.lease_timeout_s)
        hidden = {v: self.dir / f".prune-v{v}-{os.getpid()}" for v in candidates if v not in held}
        for v, path in hidden.items():
            os.replace(self.version_dir(v), path)
        held = held_versions(leases, self.lease_timeout_s) if hidden else held
        for v, path in hidden.items():
            if v in held:
                os.replace(path, self.version_dir(v))
            else:
                shutil.rmtree(path, ignore_errors=True)  # ignore_errors: a leftover goes with the next publish

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
                      if (match := _VERSION_DIR.match(entry.name)) and self._is_complete(entry))

    def latest_version(self) -> int | None:
        """The version ``LATEST`` names when that version is complete; else the newest complete one; else None."""
        try:
            text = _retry_stale(lambda: (self.dir / LATEST_FILE).read_text(encoding="utf-8"),
                                self.read_tries, self.retry_pause_s).strip()
        except OSError:
            text = ""  # missing, or stale through every try: the scan below finds the newest version
        if text.isascii() and text.isdigit() and self._is_complete(self.version_dir(int(text))):
            return int(text)
        found = self.versions()
        return found[-1] if found else None

    def _is_complete(self, folder: Path) -> bool:
        """Whether ``folder`` holds a manifest. A handle that stays stale through every try means the
        folder was removed on the NFS server."""
        try:
            return _retry_stale((folder / MANIFEST_FILE).is_file, self.read_tries, self.retry_pause_s)
        except OSError as err:
            if err.errno == errno.ESTALE:
                return False
            raise

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

        The version is leased while it is read, so the writer does not prune it meanwhile. A file that
        vanishes or goes stale (NFS) is read again, up to ``read_tries`` times.
        Raises VersionPrunedError (a WeightStoreError) when the version was pruned before or while it was
        read: load the newest instead (``load_newest``). Raises WeightStoreError naming the file when the
        version is missing, torn or corrupt, or when a file changed while it was read (re-published).
        """
        folder = self.version_dir(version)
        if not self._is_complete(folder):
            raise self._not_there(version, folder)
        with read_lease(self.dir / LEASES_DIR, version):
            return self._read_leased(version, folder, verify)

    def load_newest(self, min_version: int, timeout_s: float = 600.0, poll_s: float = 0.5) -> LoadedWeights:
        """Wait for a version >= ``min_version`` (``wait_for_version``) and load the newest; one pruned before
        or while it was read (the writer published faster than this reader loads) gives way to a newer one.
        Raises TimeoutError, or the VersionPrunedError of the last try, after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            version = self.wait_for_version(min_version, max(deadline - time.monotonic(), 0.0), poll_s)
            try:
                return self.load(version)
            except VersionPrunedError:
                if time.monotonic() >= deadline:
                    raise

    def _read_leased(self, version: int, folder: Path, verify: bool) -> LoadedWeights:
        """``_read`` until a try meets no vanished or stale file. The lease was taken after the check that
        the version exists, so the writer may have been pruning it: each try reads the manifest again."""
        for attempt in range(self.read_tries):
            if attempt:
                time.sleep(self.retry_pause_s * 2 ** (attempt - 1))
            try:
                return self._read(version, folder, verify)
            except FileVanishedError as err:
                last = err
        if not self._is_complete(folder):
            raise VersionPrunedError(f"weights version {version} ({folder}) was pruned while being read; load a "
                                     f"newer one (published now: {self.versions()})") from last
        raise WeightStoreError(f"weights version {version} ({folder}) could not be read in {self.read_tries} "
                               f"tries: {last}") from last

    def _read(self, version: int, folder: Path, verify: bool) -> LoadedWeights:
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
        state_dict = _read_tensors(folder / MODEL_FILE)
        for name in files:
            if _stat(folder / name) != stats[name]:
                raise WeightStoreError(f"{folder / name} changed while it was being read (version {version} "
                                       "re-published?); load it again")
        return LoadedWeights(version=version, kind=kind, state_dict=state_dict, adapter_config=adapter_config)

    def _not_there(self, version: int, folder: Path) -> WeightStoreError:
        """A missing version is a pruned one when a newer one is published (a reader that fell behind)."""
        published = self.versions()
        if published and published[-1] > version:
            return VersionPrunedError(f"weights version {version} is no longer in {self.dir} ({folder / MANIFEST_FILE} "
                                      f"is missing): it was pruned; load a newer one (published: {published})")
        return WeightStoreError(f"weights version {version} is not published in {self.dir} "
                                f"({folder / MANIFEST_FILE} is missing); published: {published}")

    def _read_manifest(self, folder: Path, version: int) -> dict[str, Any]:
        path = folder / MANIFEST_FILE
        manifest = _read_json(path)  # a FileVanishedError when the version was pruned since load() found it
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


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


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
