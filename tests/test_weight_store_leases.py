"""grpo.weight_store on a shared filesystem: read leases keep a version from being pruned under its reader,
stale NFS handles (ESTALE) are read again, and a version pruned mid-read is a clear VersionPrunedError."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pathlib
import shutil
import time

import pytest
import safetensors.torch
import torch

import grpo.weight_store.files as store_files
import grpo.weight_store.store as store_module
from grpo.weight_store import (
    LATEST_FILE,
    LEASES_DIR,
    MANIFEST_FILE,
    VersionPrunedError,
    WeightStore,
    WeightStoreError,
)
from grpo.weight_store.leases import read_lease


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """Tensors that differ per version in every element, so a mix-up of versions cannot pass."""
    gen = torch.Generator().manual_seed(version)
    return {"w": torch.randn(64, 64, generator=gen), "b": torch.full((7,), float(version), dtype=torch.bfloat16)}


def assert_weights_equal(loaded: dict[str, torch.Tensor], version: int) -> None:
    expected = weights_of(version)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name  # bit-identical


def fast_store(root) -> WeightStore:
    return WeightStore(root, retry_pause_s=0.001)  # the retries' pauses only slow the tests down


def publish(store: WeightStore, version: int, keep: int = 1) -> None:
    store.publish(version, weights_of(version), kind="full", keep=keep)


def leases_left(store: WeightStore) -> list[str]:
    leases = store.dir / LEASES_DIR
    return sorted(p.name for p in leases.iterdir()) if leases.is_dir() else []


def fail_first(monkeypatch, owner, name: str, times: int, error: Exception, when=lambda *args: True) -> list:
    """Make ``owner.name`` raise ``error`` on its first ``times`` calls that ``when(*args)`` selects;
    returns the list of the calls that failed (for counting)."""
    real = getattr(owner, name)
    failed = []

    def flaky(*args, **kwargs):
        if len(failed) < times and when(*args):
            failed.append(args)
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    return failed


def stale() -> OSError:
    return OSError(errno.ESTALE, os.strerror(errno.ESTALE))


# ------------------------------------------------------------ leases


def test_a_leased_version_survives_publishes_that_would_prune_it_and_goes_after_release(tmp_path):
    store = fast_store(tmp_path)
    publish(store, 1)
    with read_lease(store.dir / LEASES_DIR, 1):
        publish(store, 2)
        publish(store, 3)
        assert store.versions() == [1, 3]  # keep=1 newest, plus the leased one
        assert_weights_equal(store.load(1).state_dict, 1)
        publish(store, 4, keep=2)
        assert store.versions() == [1, 3, 4]  # keep is "at least the newest keep"
    assert leases_left(store) == []
    assert store.versions() == [1, 3, 4]  # released: pruned by the next publish, not before
    publish(store, 5)
    assert store.versions() == [5]


def test_a_load_in_progress_keeps_its_version(tmp_path, monkeypatch):
    """The writer publishes (keep=1) while a reader is hashing the version it loads: the reader still
    gets every tensor of its version, which goes with the publish after it."""
    store = fast_store(tmp_path)
    publish(store, 1)
    real_sha256 = store_files._sha256

    def publish_meanwhile(path):
        if store.latest_version() == 1:
            assert leases_left(store) and leases_left(store)[0].startswith("v1.")
            publish(store, 2)
        return real_sha256(path)

    monkeypatch.setattr(store_files, "_sha256", publish_meanwhile)
    assert_weights_equal(store.load(1).state_dict, 1)
    assert store.versions() == [1, 2] and leases_left(store) == []
    publish(store, 3)
    assert store.versions() == [3]


def test_an_expired_lease_does_not_pin_its_version(tmp_path):
    store = WeightStore(tmp_path, lease_timeout_s=5.0)
    publish(store, 1)
    with read_lease(store.dir / LEASES_DIR, 1) as lease:
        old = time.time() - 10  # a reader killed with kill -9 ten seconds ago
        os.utime(lease, (old, old))
        publish(store, 2)
        assert store.versions() == [2]
        assert not lease.exists()  # the expired lease is cleared by the writer
    assert leases_left(store) == []


def test_a_lease_taken_while_the_writer_prunes_keeps_the_version(tmp_path, monkeypatch):
    """The race: a reader leases v1 just after the writer's first look at the leases. The writer hides
    v1, looks again, sees the lease and puts v1 back."""
    store = fast_store(tmp_path)
    publish(store, 1)
    real_held = store_module.held_versions
    looks = []

    def reader_leases_after_the_first_look(leases_dir, timeout_s):
        held = real_held(leases_dir, timeout_s)
        looks.append(held)
        if len(looks) == 1:
            leases_dir.mkdir(exist_ok=True)
            (leases_dir / "v1.otherhost-1-abcd").touch()
        return held

    monkeypatch.setattr(store_module, "held_versions", reader_leases_after_the_first_look)
    publish(store, 2)
    assert looks == [set(), {1}]
    assert store.versions() == [1, 2] and sorted(p.name for p in store.dir.iterdir()) == [
        LATEST_FILE, LEASES_DIR, "v1", "v2"]  # put back under its name, nothing hidden left over
    assert_weights_equal(store.load(1).state_dict, 1)


# ------------------------------------------------------------ stale handles and pruned versions


@pytest.mark.parametrize("read", ["manifest", "hash", "tensors"])
def test_a_stale_handle_once_is_read_again(tmp_path, monkeypatch, read):
    store = fast_store(tmp_path)
    publish(store, 1)
    if read == "manifest":
        failed = fail_first(monkeypatch, pathlib.Path, "read_text", 2, stale(),
                            when=lambda path, *args: path.name == MANIFEST_FILE)
    elif read == "hash":
        failed = fail_first(monkeypatch, store_files, "_sha256", 1, stale())
    else:
        failed = fail_first(monkeypatch, safetensors.torch, "load_file", 1, stale())
    loaded = store.load(1)
    assert failed  # the stale read did happen
    assert loaded.version == 1
    assert_weights_equal(loaded.state_dict, 1)
    assert leases_left(store) == []


def test_a_handle_that_stays_stale_is_an_error_naming_the_version(tmp_path, monkeypatch):
    store = fast_store(tmp_path)
    publish(store, 1)
    failed = fail_first(monkeypatch, safetensors.torch, "load_file", 1000, stale())
    with pytest.raises(WeightStoreError, match=r"weights version 1 \(.*v1\) could not be read in 4 tries") as info:
        store.load(1)
    assert not isinstance(info.value, VersionPrunedError)  # the version is still there
    assert len(failed) == 4 and leases_left(store) == []


def test_a_version_pruned_mid_load_is_a_clear_error(tmp_path, monkeypatch):
    store = fast_store(tmp_path)
    publish(store, 1, keep=2)
    publish(store, 2, keep=2)
    real_sha256 = store_files._sha256

    def pruned_meanwhile(path):
        shutil.rmtree(store.version_dir(1), ignore_errors=True)  # what a writer that ignored the lease does
        return real_sha256(path)

    monkeypatch.setattr(store_files, "_sha256", pruned_meanwhile)
    with pytest.raises(VersionPrunedError, match=r"weights version 1 \(.*v1\) was pruned while being read"):
        store.load(1)
    assert leases_left(store) == []
    monkeypatch.undo()
    # Pruned before the load started, with a newer one published: the same kind of error.
    with pytest.raises(VersionPrunedError, match="weights version 1 is no longer in .*it was pruned"):
        store.load(1)
    # Not published at all: an ordinary WeightStoreError.
    with pytest.raises(WeightStoreError, match="weights version 3 is not published") as info:
        store.load(3)
    assert not isinstance(info.value, VersionPrunedError)


def test_load_newest_follows_a_pruned_version_to_the_newest(tmp_path, monkeypatch):
    store = fast_store(tmp_path)
    publish(store, 1)
    publish(store, 2)  # v1 pruned
    real_latest = store.latest_version
    answers = iter([1])  # a view from before v2: what a reader that fell behind sees
    monkeypatch.setattr(store, "latest_version", lambda: next(answers, None) or real_latest())
    loaded = store.load_newest(1, timeout_s=5, poll_s=0.01)
    assert loaded.version == 2
    assert_weights_equal(loaded.state_dict, 2)


def test_a_stale_latest_file_is_read_again(tmp_path, monkeypatch):
    store = fast_store(tmp_path)
    publish(store, 1, keep=2)
    publish(store, 2, keep=2)
    shutil.copytree(store.dir / "v2", store.dir / "v5")  # a scan of the folders would say 5; LATEST says 2
    failed = fail_first(monkeypatch, pathlib.Path, "read_text", 2, stale(),
                        when=lambda path, *args: path.name == LATEST_FILE)
    assert store.wait_for_version(2, timeout_s=0) == 2
    assert len(failed) == 2


# ------------------------------------------------------------ two processes


def publish_versions(root: str, count: int) -> None:
    """The writer process: versions 1..count as fast as it can, keeping only the newest."""
    store = WeightStore(root)
    for version in range(1, count + 1):
        publish(store, version)


def test_a_reader_racing_a_fast_writer_gets_verified_weights_or_a_clear_error(tmp_path):
    """A writer process publishes 1..N with keep=1 while this process loads the newest over and over:
    every load that succeeds is verified (checksums) and bit-identical to its version; the only error
    allowed is VersionPrunedError."""
    count = 30
    writer = multiprocessing.get_context("spawn").Process(target=publish_versions, args=(str(tmp_path), count))
    writer.start()
    store = fast_store(tmp_path)
    loads, pruned = 0, 0
    try:
        while writer.is_alive() or (loads == 0 and writer.exitcode == 0):  # a crashed writer ends the loop
            latest = store.latest_version()
            if latest is None:
                time.sleep(0.01)
                continue
            try:
                loaded = store.load(latest)  # verify=True: sizes and SHA-256 checked against the manifest
            except VersionPrunedError:
                pruned += 1
                continue
            assert loaded.version == latest
            assert_weights_equal(loaded.state_dict, latest)
            loads += 1
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0
    assert store.latest_version() == count and count in store.versions()
    assert_weights_equal(store.load(count).state_dict, count)
    assert leases_left(store) == []
