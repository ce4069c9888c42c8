"""grpo.weight_store: exact round trips (full model, LoRA), torn/corrupt files, pruning, crashes mid-publish."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import safetensors.torch
import torch

from grpo.models.tiny import build_qwen2
from grpo.weight_store import (
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    WeightStore,
    WeightStoreError,
    apply_to_model,
    state_dict_for_publish,
)


@pytest.fixture
def input_ids(tiny_tokenizer):
    return torch.tensor([tiny_tokenizer.encode("Tom has 12 apples and buys 7 more.")])


def logits_of(model, input_ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def make_lora(tiny_tokenizer, adapter_seed: int | None):
    """A peft LoRA model over the seed-0 base; ``adapter_seed`` randomises the adapter (lora_B starts at 0,
    which would make every adapter look equal)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_qwen2(tiny_tokenizer, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    if adapter_seed is not None:
        gen = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def publish_model(store, version, model, keep=2):
    state, kind, adapter_config = state_dict_for_publish(model)
    return store.publish(version, state, kind=kind, adapter_config=adapter_config, keep=keep)


def test_full_round_trip_gives_identical_logits(tmp_path, tiny_tokenizer, input_ids):
    trained = build_qwen2(tiny_tokenizer, seed=0)
    store = WeightStore(tmp_path)
    path = publish_model(store, 3, trained)
    assert path == tmp_path / "weights" / "v3"
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["version"] == 3 and manifest["kind"] == "full"
    assert manifest["files"][MODEL_FILE]["bytes"] == (path / MODEL_FILE).stat().st_size
    assert store.latest_version() == 3 and (tmp_path / "weights" / LATEST_FILE).read_text().strip() == "3"

    loaded = store.load(3)
    assert loaded.version == 3 and loaded.kind == "full" and loaded.adapter_config is None
    own = trained.state_dict()
    # lm_head.weight is tied to the embeddings: published once, under the embedding's name.
    assert "lm_head.weight" not in loaded.state_dict and set(loaded.state_dict) == set(own) - {"lm_head.weight"}
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, own[name]), name

    fresh = build_qwen2(tiny_tokenizer, seed=1)
    assert not torch.equal(logits_of(fresh, input_ids), logits_of(trained, input_ids))
    apply_to_model(fresh, loaded)
    assert torch.equal(logits_of(fresh, input_ids), logits_of(trained, input_ids))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied after loading


def test_lora_round_trip_gives_identical_logits(tmp_path, tiny_tokenizer, input_ids):
    trained = make_lora(tiny_tokenizer, adapter_seed=1)
    store = WeightStore(tmp_path)
    path = publish_model(store, 1, trained)
    assert (path / "adapter_config.json").is_file()
    loaded = store.load(1)
    assert loaded.kind == "lora" and loaded.adapter_config["r"] == 4 and loaded.adapter_config["lora_alpha"] == 8
    assert loaded.state_dict and all("lora_" in name for name in loaded.state_dict)  # the adapter only

    fresh = make_lora(tiny_tokenizer, adapter_seed=2)
    assert not torch.equal(logits_of(fresh, input_ids), logits_of(trained, input_ids))
    apply_to_model(fresh, loaded)
    assert torch.equal(logits_of(fresh, input_ids), logits_of(trained, input_ids))


def test_apply_refuses_the_wrong_kind_of_model(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    publish_model(store, 0, make_lora(tiny_tokenizer, adapter_seed=1))
    publish_model(store, 1, build_qwen2(tiny_tokenizer, seed=0))
    with pytest.raises(WeightStoreError, match="not a peft model"):
        apply_to_model(build_qwen2(tiny_tokenizer), store.load(0))
    with pytest.raises(WeightStoreError, match="is a peft model"):
        apply_to_model(make_lora(tiny_tokenizer, adapter_seed=None), store.load(1))
    bigger = build_qwen2(tiny_tokenizer, hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(WeightStoreError, match="shape"):
        apply_to_model(bigger, store.load(1))


def test_corrupt_byte_is_detected(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    path = publish_model(store, 0, build_qwen2(tiny_tokenizer))
    file = path / MODEL_FILE
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: safetensors alone would parse it happily
    file.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match=f"{MODEL_FILE}.*SHA-256"):
        store.load(0)


def test_truncated_file_is_detected(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    path = publish_model(store, 0, build_qwen2(tiny_tokenizer))
    file = path / MODEL_FILE
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(WeightStoreError, match=f"{MODEL_FILE} has .* bytes"):
        store.load(0)
    # Without the check the parser still refuses it; never partial weights.
    with pytest.raises(WeightStoreError, match=MODEL_FILE):
        store.load(0, verify=False)


def test_missing_model_file_and_bad_manifest(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    path = publish_model(store, 0, build_qwen2(tiny_tokenizer))
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    (path / MODEL_FILE).unlink()
    with pytest.raises(WeightStoreError, match=f"{MODEL_FILE} is missing"):
        store.load(0)
    # A manifest may only name this format's files: no path out of the folder.
    manifest["files"]["../../escape"] = {"sha256": "0" * 64, "bytes": 1}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(WeightStoreError, match="unexpected file"):
        store.load(0)
    (path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(WeightStoreError, match=MANIFEST_FILE):
        store.load(0)


def test_folder_without_manifest_is_not_a_version(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    publish_model(store, 0, build_qwen2(tiny_tokenizer), keep=5)
    path = publish_model(store, 1, build_qwen2(tiny_tokenizer), keep=5)
    (path / MANIFEST_FILE).unlink()
    assert store.versions() == [0]
    assert store.latest_version() == 0  # LATEST names v1, which is incomplete: fall back to the scan
    with pytest.raises(WeightStoreError, match="not published"):
        store.load(1)
    (tmp_path / "weights" / LATEST_FILE).unlink()
    assert store.latest_version() == 0
    assert WeightStore(tmp_path / "empty").latest_version() is None


def test_pruning_keeps_the_newest(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    state, kind, _ = state_dict_for_publish(build_qwen2(tiny_tokenizer))
    for version in range(5):
        store.publish(version, state, kind=kind, keep=2)
        assert store.versions() == list(range(max(version - 1, 0), version + 1))
    store.publish(5, state, kind=kind, keep=1)
    assert store.versions() == [5]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [LATEST_FILE, "v5"]


def test_republishing_an_earlier_version_drops_the_abandoned_newer_ones(tmp_path, tiny_tokenizer, input_ids):
    """A trainer resumed from step 2 re-publishes v3: the v3/v4 of the abandoned run must not be served."""
    store = WeightStore(tmp_path)
    for version in range(5):
        publish_model(store, version, build_qwen2(tiny_tokenizer, seed=version), keep=3)
    resumed = build_qwen2(tiny_tokenizer, seed=10)
    publish_model(store, 3, resumed, keep=3)
    assert store.versions() == [2, 3] and store.latest_version() == 3  # v4 dropped; v0, v1 pruned earlier
    fresh = build_qwen2(tiny_tokenizer, seed=0)
    apply_to_model(fresh, store.load(3))
    assert torch.equal(logits_of(fresh, input_ids), logits_of(resumed, input_ids))


def test_crash_at_the_rename_leaves_the_previous_version(tmp_path, tiny_tokenizer, monkeypatch):
    store = WeightStore(tmp_path)
    state, kind, _ = state_dict_for_publish(build_qwen2(tiny_tokenizer))
    store.publish(1, state, kind=kind)

    def failing_replace(src, dst):
        raise OSError("simulated crash at rename")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        store.publish(2, state, kind=kind)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [LATEST_FILE, "v1"]  # no temp left
    assert store.latest_version() == 1 and store.versions() == [1]
    assert set(store.load(1).state_dict) == set(state)


def test_crash_while_writing_leaves_the_previous_version(tmp_path, tiny_tokenizer, monkeypatch):
    store = WeightStore(tmp_path)
    state, kind, _ = state_dict_for_publish(build_qwen2(tiny_tokenizer))
    store.publish(1, state, kind=kind)

    def torn_write(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # a partial file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", torn_write)
    with pytest.raises(OSError, match="No space"):
        store.publish(2, state, kind=kind)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [LATEST_FILE, "v1"]
    assert store.latest_version() == 1
    store.load(1)
    # A publish killed outright leaves its temp folder; the next publish removes it.
    (tmp_path / "weights" / ".tmp-v2-99999").mkdir()
    store.publish(2, state, kind=kind)
    # leases/: made by the load above (a reader's lease on v1, already released)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [LATEST_FILE, "leases", "v1", "v2"]
    assert not any((tmp_path / "weights" / "leases").iterdir())


def test_wait_for_version(tmp_path, tiny_tokenizer):
    store = WeightStore(tmp_path)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no weights version >= 0 .* within 0.2 s \(latest: None\)"):
        store.wait_for_version(0, timeout_s=0.2, poll_s=0.05)
    assert time.monotonic() - start < 2

    state, kind, _ = state_dict_for_publish(build_qwen2(tiny_tokenizer))
    store.publish(0, state, kind=kind)
    publisher = threading.Timer(0.2, lambda: store.publish(1, state, kind=kind))
    publisher.start()
    try:
        assert store.wait_for_version(1, timeout_s=10, poll_s=0.02) == 1
    finally:
        publisher.join()
    with pytest.raises(TimeoutError, match="latest: 1"):
        store.wait_for_version(2, timeout_s=0.05, poll_s=0.01)


@pytest.mark.parametrize("bad", [-1, "1", "../v1", 1.0, True, None])
def test_bad_versions_are_refused(tmp_path, bad):
    store = WeightStore(tmp_path)
    state = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="non-negative int"):
        store.publish(bad, state, kind="full")
    with pytest.raises(ValueError, match="non-negative int"):
        store.load(bad)
    with pytest.raises(ValueError, match="non-negative int"):
        store.wait_for_version(bad, timeout_s=0)
    assert not (tmp_path / "weights").exists()


def test_bad_publish_arguments_fail_before_touching_the_disk(tmp_path):
    store = WeightStore(tmp_path)
    weight = torch.ones(4, 4)
    with pytest.raises(ValueError, match="share memory"):
        store.publish(0, {"a": weight, "b": weight}, kind="full")
    with pytest.raises(ValueError, match="kind"):
        store.publish(0, {"a": weight}, kind="delta")
    with pytest.raises(ValueError, match="adapter_config"):
        store.publish(0, {"a": weight}, kind="lora")
    with pytest.raises(ValueError, match="keep"):
        store.publish(0, {"a": weight}, kind="full", keep=0)
    assert not (tmp_path / "weights").exists()
