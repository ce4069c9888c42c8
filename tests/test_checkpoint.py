"""grpo.run.checkpoint: exact round trips (full model, LoRA, optimizer, scheduler, RNG) and failure paths."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from grpo.models.tiny import build_qwen2
from grpo.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_final,
)


def make_optimizer(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return optimizer, scheduler


def train_step(model, optimizer, scheduler, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def assert_identical(a, b, where="state"):
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def batch(tiny_tokenizer):
    return torch.tensor([tiny_tokenizer.encode("Tom has 12 apples and buys 7 more.")])


@pytest.fixture
def trained(tiny_tokenizer, batch):
    """A tiny Qwen2 after one AdamW step, with its optimizer and scheduler."""
    model = build_qwen2(tiny_tokenizer, seed=0)
    optimizer, scheduler = make_optimizer(model)
    train_step(model, optimizer, scheduler, batch)
    return model, optimizer, scheduler


def save(tmp_path, step, trained, tokenizer, limit=None, state=None):
    model, optimizer, scheduler = trained
    return save_checkpoint(tmp_path, step, model, tokenizer, optimizer, scheduler,
                           state if state is not None else {"data_position": step * 4}, limit)


def test_full_model_round_trip_is_exact(tmp_path, tiny_tokenizer, trained, batch):
    model, optimizer, scheduler = trained
    path = save_checkpoint(tmp_path, 1, model, tiny_tokenizer, optimizer, scheduler,
                           {"data_position": 8, "consumed_batch_ids": [0, 1], "metrics": {"kl": float("nan")}}, None)
    assert path == tmp_path / "checkpoints" / "step-1"
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "scheduler.pt", "rng.pt",
            "trainer_state.json"} <= set(os.listdir(path))

    restored = build_qwen2(tiny_tokenizer, seed=1)  # different weights: the load must overwrite them all
    restored_optimizer, restored_scheduler = make_optimizer(restored)
    state = load_checkpoint(path, restored, restored_optimizer, restored_scheduler)

    # NaN metrics are stored as JSON null so trainer_state.json stays valid JSON.
    assert state == {"data_position": 8, "consumed_batch_ids": [0, 1], "metrics": {"kl": None}, "step": 1}
    assert_identical(model.state_dict(), restored.state_dict(), "model")
    assert restored.lm_head.weight is restored.model.embed_tokens.weight  # tying survives the load
    assert_identical(optimizer.state_dict(), restored_optimizer.state_dict(), "optimizer")
    assert_identical(scheduler.state_dict(), restored_scheduler.state_dict(), "scheduler")

    # The next step is bit-identical on the original and on the restored copy.
    train_step(model, optimizer, scheduler, batch)
    train_step(restored, restored_optimizer, restored_scheduler, batch)
    assert_identical(model.state_dict(), restored.state_dict(), "model after next step")


def test_weights_that_do_not_match_the_model_are_an_error(tmp_path, tiny_tokenizer, trained):
    path = save(tmp_path, 1, trained, tiny_tokenizer)
    # An untied model needs lm_head.weight, which a tied checkpoint does not hold.
    untied = build_qwen2(tiny_tokenizer, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"step-1.*lm_head\.weight"):
        load_checkpoint(path, untied, restore_rng=False)


def lora_model(tokenizer, seed):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_qwen2(tokenizer, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero; random values make the round trip meaningful
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def lora_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_round_trip_saves_only_the_adapter(tmp_path, tiny_tokenizer):
    model = lora_model(tiny_tokenizer, seed=0)
    optimizer, scheduler = make_optimizer(model)
    path = save_checkpoint(tmp_path, 3, model, tiny_tokenizer, optimizer, scheduler, {}, None)
    files = set(os.listdir(path))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files and "model.safetensors.index.json" not in files

    restored = lora_model(tiny_tokenizer, seed=1)
    assert not torch.equal(*[next(iter(lora_weights(m).values())) for m in (model, restored)])
    restored_optimizer, restored_scheduler = make_optimizer(restored)
    assert load_checkpoint(path, restored, restored_optimizer, restored_scheduler) == {"step": 3}
    assert_identical(lora_weights(model), lora_weights(restored), "adapter")
    assert_identical(optimizer.state_dict(), restored_optimizer.state_dict(), "optimizer")


def test_lora_checkpoint_into_a_full_model_is_an_error(tmp_path, tiny_tokenizer):
    path = save_checkpoint(tmp_path, 1, lora_model(tiny_tokenizer, 0), None, None, None, {}, None)
    with pytest.raises(CheckpointError, match="LoRA adapter"):
        load_checkpoint(path, build_qwen2(tiny_tokenizer))


def test_save_final_writes_loadable_hf_folders(tmp_path, tiny_tokenizer, trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained[0]
    final = save_final(tmp_path, model, tiny_tokenizer)
    assert final == tmp_path / "final"
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    assert_identical(model.state_dict(), reloaded.state_dict(), "final model")
    assert AutoTokenizer.from_pretrained(final).encode("12 apples") == tiny_tokenizer.encode("12 apples")

    # Saving again replaces the folder; a LoRA final holds the adapter and its config only.
    lora_dir = save_final(tmp_path / "lora", lora_model(tiny_tokenizer, 0), tiny_tokenizer)
    files = set(os.listdir(lora_dir))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    assert save_final(tmp_path, model, None) == final and "tokenizer.json" not in os.listdir(final)


def test_rng_states_are_restored(tmp_path, tiny_tokenizer, trained):
    path = save(tmp_path, 1, trained, tiny_tokenizer)
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    load_checkpoint(path, trained[0])
    again = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(expected[0], again[0])
    assert expected[1] == again[1]
    assert np.array_equal(expected[2], again[2])

    load_checkpoint(path, trained[0], restore_rng=False)  # leaves the RNG streams alone
    assert not torch.equal(torch.rand(4), expected[0])


def test_pruning_keeps_the_newest(tmp_path, tiny_tokenizer, trained):
    for step in (1, 2, 3):
        save(tmp_path, step, trained, tiny_tokenizer, limit=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-2", "step-3"]
    save(tmp_path, 10, trained, tiny_tokenizer, limit=1)
    assert os.listdir(tmp_path / "checkpoints") == ["step-10"]
    with pytest.raises(ValueError, match="save_total_limit"):
        save(tmp_path, 11, trained, tiny_tokenizer, limit=0)


def test_latest_checkpoint_ignores_incomplete_folders(tmp_path, tiny_tokenizer, trained):
    assert latest_checkpoint(tmp_path) is None
    save(tmp_path, 2, trained, tiny_tokenizer)
    save(tmp_path, 10, trained, tiny_tokenizer)  # 10 > 2 numerically, though "10" < "2" as text
    (tmp_path / "checkpoints" / "step-20").mkdir()  # no trainer_state.json: a torn copy
    leftover = tmp_path / "checkpoints" / ".tmp-step-30-12345"
    leftover.mkdir()
    (leftover / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-10"


def test_resaving_a_step_replaces_it(tmp_path, tiny_tokenizer, trained):
    save(tmp_path, 1, trained, tiny_tokenizer, state={"data_position": 1})
    path = save(tmp_path, 1, trained, tiny_tokenizer, state={"data_position": 2})
    assert json.loads((path / "trainer_state.json").read_text())["data_position"] == 2
    assert os.listdir(tmp_path / "checkpoints") == ["step-1"]


@pytest.mark.parametrize("failing", ["torch.save", "os.fsync"])
def test_disk_full_leaves_previous_checkpoint_intact(tmp_path, tiny_tokenizer, trained, monkeypatch, failing):
    save(tmp_path, 1, trained, tiny_tokenizer)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    module, name = failing.split(".")
    monkeypatch.setattr({"torch": torch, "os": os}[module], name, disk_full)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 2, trained, tiny_tokenizer, limit=1)
    monkeypatch.undo()

    # No step-2 (not even half of one), no temp folder, and step-1 (not pruned) still loads.
    assert os.listdir(tmp_path / "checkpoints") == ["step-1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"
    restored = build_qwen2(tiny_tokenizer, seed=1)
    assert load_checkpoint(tmp_path / "checkpoints" / "step-1", restored)["step"] == 1
    assert_identical(trained[0].state_dict(), restored.state_dict(), "model")


def test_next_save_cleans_up_after_a_killed_save(tmp_path, tiny_tokenizer, trained):
    """Killed while re-saving step-1, between moving the old folder aside and renaming the new one in."""
    checkpoints = save(tmp_path, 1, trained, tiny_tokenizer).parent
    os.replace(checkpoints / "step-1", checkpoints / ".old-step-1-99999")
    (checkpoints / ".tmp-step-1-99999").mkdir()
    (checkpoints / ".tmp-step-2-99998").mkdir()
    assert latest_checkpoint(tmp_path) is None

    save(tmp_path, 3, trained, tiny_tokenizer)
    assert sorted(os.listdir(checkpoints)) == ["step-1", "step-3"]  # old one put back, debris removed
    assert load_checkpoint(checkpoints / "step-1", build_qwen2(tiny_tokenizer))["step"] == 1


def test_unserialisable_trainer_state_fails_before_writing(tmp_path, tiny_tokenizer, trained):
    with pytest.raises(TypeError, match="trainer_state"):
        save(tmp_path, 1, trained, tiny_tokenizer, state={"sampler": object()})
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("file", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt",
                                  "trainer_state.json"])
def test_torn_file_gives_checkpoint_error_naming_it(tmp_path, tiny_tokenizer, trained, file):
    path = save(tmp_path, 1, trained, tiny_tokenizer)
    data = (path / file).read_bytes()
    (path / file).write_bytes(data[: len(data) // 2])
    model = build_qwen2(tiny_tokenizer)
    optimizer, scheduler = make_optimizer(model)
    with pytest.raises(CheckpointError, match=file.replace(".", r"\.")):
        load_checkpoint(path, model, optimizer, scheduler)


def test_missing_files_give_checkpoint_error(tmp_path, tiny_tokenizer, trained):
    path = save(tmp_path, 1, trained, tiny_tokenizer)
    (path / "optimizer.pt").unlink()
    model = build_qwen2(tiny_tokenizer)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is missing"):
        load_checkpoint(path, model, make_optimizer(model)[0])
    (path / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(path, model)


def test_save_best_writes_the_adapter_and_its_step(tmp_path, tiny_tokenizer):
    """best/ is written as final/ is (a LoRA run: the adapter only), with best.json naming the step; a better
    evaluation later replaces it whole."""
    from peft import PeftModel

    from grpo.run.checkpoint import save_best

    model = lora_model(tiny_tokenizer, seed=0)
    path = save_best(tmp_path, model, tiny_tokenizer, 4, "eval/accuracy", 0.25)
    assert path == tmp_path / "best"
    assert {"adapter_model.safetensors", "adapter_config.json", "best.json"} <= set(os.listdir(path))
    assert "model.safetensors" not in os.listdir(path)
    assert json.loads((path / "best.json").read_text()) == {"step": 4, "metric": "eval/accuracy", "value": 0.25}
    loaded = PeftModel.from_pretrained(build_qwen2(tiny_tokenizer, seed=0), path)
    assert_identical(lora_weights(model), lora_weights(loaded), "adapter")
    later = lora_model(tiny_tokenizer, seed=1)
    save_best(tmp_path, later, tiny_tokenizer, 9, "eval/accuracy", 0.5)
    assert json.loads((path / "best.json").read_text())["step"] == 9
    assert_identical(lora_weights(later), lora_weights(PeftModel.from_pretrained(build_qwen2(tiny_tokenizer, seed=0),
                                                                                   path)), "adapter")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left
