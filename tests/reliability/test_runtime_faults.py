"""Faults during a run: flaky and broken rewards, NaN losses, a full disk, a torn checkpoint, another run's folder."""

from __future__ import annotations

import errno
import json
import logging
import shutil

import pytest
import torch
from reliability_helpers import run_args, snapshot
from run_helpers import read_metrics, train_rows, without_timings
from safetensors.torch import load_file

import grpo.run.checkpoint as checkpoint_module
import grpo.training.loop as trainer_module
from grpo.cli import main
from grpo.run.checkpoint import complete_checkpoints, latest_checkpoint, load_checkpoint
from grpo.step import micro_batch_loss as optimization

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def train(recipe, model_dir, out, *flags, **extra) -> int:
    return main(["train", str(recipe), *run_args(model_dir, out, **extra), *flags])


def grpo_message(err: str) -> str:
    """The one line the command line printed about the failure (not the progress bars)."""
    lines = [line for line in err.splitlines() if line.startswith("grpo: ")]
    assert lines, err
    return lines[-1]


def samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def model_weights(checkpoint):
    return load_file(checkpoint / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- rewards


def test_reward_that_raises_abstains_for_those_samples_and_is_logged_once(tiny_model_dir, recipe, tmp_path, caplog):
    out = tmp_path / "run"
    rewards = "[{name: 'rewards_for_reliability:raises_on_odd_length'}, {name: 'rewards_for_tests:letters'}]"
    with caplog.at_level(logging.WARNING, logger="grpo.rewards"):
        assert train(recipe, tiny_model_dir, out, **{"train.max_steps": 3, "rewards": rewards}) == 0
    rows = samples(out)
    odd = [r for r in rows if len(r["completion"]) % 2]
    assert odd and len(odd) < len(rows), "the test needs completions of both parities"
    for row in rows:
        expected = None if len(row["completion"]) % 2 else 1.0
        assert row["rewards"]["raises_on_odd_length"] == expected, row
        assert row["rewards"]["letters"] is not None
    failures = [r for r in caplog.records if "raised" in r.getMessage()]
    assert len(failures) == 1, "the first failure is logged with its sample, later ones only counted"
    assert "raises_on_odd_length" in failures[0].getMessage() and failures[0].exc_info is not None


def test_nan_reward_abstains(tiny_model_dir, recipe, tmp_path, caplog):
    out = tmp_path / "run"
    rewards = "[{name: 'rewards_for_reliability:nan_for_all'}, {name: 'rewards_for_tests:letters'}]"
    with caplog.at_level(logging.WARNING, logger="grpo.rewards"):
        assert train(recipe, tiny_model_dir, out, rewards=rewards) == 0
    for row in train_rows(out):
        assert row["reward/nan_for_all"] is None  # no value at all, not a NaN that poisons the mean
        assert row["reward/mean"] == pytest.approx(row["reward/letters"], abs=1e-6)
    assert all(r["rewards"]["nan_for_all"] is None for r in samples(out))
    assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 1


# ---------------------------------------------------------------- NaN losses


@pytest.fixture()
def nan_loss_at(monkeypatch):
    """``nan_loss_at(steps)``: the loss is NaN (so are the gradients) in those steps of this process."""
    def arrange(steps: set[int]) -> None:
        real_train, real_loss = trainer_module.train_on_batch, optimization.policy_loss
        calls = {"step": 0}

        def nan_loss(*args, **kwargs):
            loss, stats = real_loss(*args, **kwargs)
            return loss * float("nan"), stats

        def train_on_batch(*args, **kwargs):
            calls["step"] += 1
            monkeypatch.setattr(optimization, "policy_loss", nan_loss if calls["step"] in steps else real_loss)
            return real_train(*args, **kwargs)

        monkeypatch.setattr(trainer_module, "train_on_batch", train_on_batch)
    return arrange


def test_a_nan_step_is_skipped_and_counted(tiny_model_dir, recipe, tmp_path, nan_loss_at):
    out = tmp_path / "run"
    nan_loss_at({2})
    assert train(recipe, tiny_model_dir, out, **{"train.max_steps": 3, "train.save_total_limit": None}) == 0
    assert [r["skipped_updates"] for r in train_rows(out)] == [0.0, 1.0, 0.0]
    step1, step2, step3 = (model_weights(out / "checkpoints" / f"step-{n}") for n in (1, 2, 3))
    assert same_weights(step1, step2), "the NaN step's update was applied"
    assert not same_weights(step2, step3), "training went on after the skipped step"
    assert all(torch.isfinite(t).all() for t in step3.values())


def test_k_nan_steps_in_a_row_abort_with_the_last_checkpoint_intact_and_resumable(tiny_model_dir, recipe, tmp_path,
                                                                                  nan_loss_at, monkeypatch, capsys):
    out = tmp_path / "run"
    extra = {"train.max_steps": 5, "optim.max_skipped_steps": 2, "train.save_total_limit": None}
    nan_loss_at({2, 3, 4, 5})
    assert train(recipe, tiny_model_dir, out, **extra) == 1
    message = grpo_message(capsys.readouterr().err)
    assert message.startswith("grpo: training aborted: step 3: the gradients were non-finite (NaN/inf) in 2 "
                              "consecutive steps (optim.max_skipped_steps 2)"), message
    assert [r["skipped_updates"] for r in train_rows(out)] == [0.0, 1.0, 1.0]
    newest = latest_checkpoint(out)
    assert newest.name == "step-3"
    assert same_weights(model_weights(newest), model_weights(out / "checkpoints" / "step-1"))
    from transformers import AutoModelForCausalLM

    assert load_checkpoint(newest, AutoModelForCausalLM.from_pretrained(tiny_model_dir))["step"] == 3

    monkeypatch.undo()  # the cause is fixed: --resume finishes the run
    assert train(recipe, tiny_model_dir, out, "--resume", **extra) == 0
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4, 5]
    assert [r["skipped_updates"] for r in train_rows(out)][3:] == [0.0, 0.0]


# ---------------------------------------------------------------- disk full


def test_disk_full_while_saving_keeps_the_previous_checkpoint_and_resume_finishes(tiny_model_dir, recipe, tmp_path,
                                                                                  monkeypatch, capsys):
    out = tmp_path / "run"
    real_save_model = checkpoint_module._save_model

    def full_disk_at_step_2(model, folder, state_dict=None):
        real_save_model(model, folder, state_dict)  # the weights are written, then the disk is full
        if folder.name.startswith(".tmp-step-2-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "optimizer.pt"))

    monkeypatch.setattr(checkpoint_module, "_save_model", full_disk_at_step_2)
    assert train(recipe, tiny_model_dir, out, **{"train.max_steps": 3}) == 1
    message = grpo_message(capsys.readouterr().err)
    assert "No space left on device" in message and "optimizer.pt" in message, message
    assert [p.name for p in complete_checkpoints(out)] == ["step-1"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"], "a partial save was left behind"
    from transformers import AutoModelForCausalLM

    assert load_checkpoint(out / "checkpoints" / "step-1", AutoModelForCausalLM.from_pretrained(tiny_model_dir))

    monkeypatch.undo()  # space was freed
    assert train(recipe, tiny_model_dir, out, "--resume", **{"train.max_steps": 3}) == 0
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]


# ---------------------------------------------------------------- torn checkpoint


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, recipe, tmp_path_factory):
    """4 steps, a checkpoint of each kept."""
    from run_helpers import rewards_on_path

    out = tmp_path_factory.mktemp("finished") / "run"
    with rewards_on_path():
        assert train(recipe, tiny_model_dir, out, **{"train.max_steps": 4, "train.save_total_limit": None}) == 0
    return out


def truncate(file, keep_fraction=0.5):
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep_fraction)])


def test_torn_newest_checkpoint_falls_back_to_the_previous_one(finished_run, tiny_model_dir, recipe, tmp_path, capsys):
    # As if killed before step 4 was saved, and step 3's weights were then damaged on disk.
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    shutil.rmtree(out / "final")
    torn = out / "checkpoints" / "step-3" / "model.safetensors"
    truncate(torn)
    assert train(recipe, tiny_model_dir, out, "--resume",
                 **{"train.max_steps": 4, "train.save_total_limit": None}) == 0
    err = capsys.readouterr().err
    assert f"grpo: warning: cannot resume from {out / 'checkpoints' / 'step-3'}: {torn} cannot be read" in err, err
    # Steps 3 and 4 were trained again from step 2's checkpoint: the same run as without the damage.
    assert [without_timings(r) for r in read_metrics(out)] == [without_timings(r) for r in read_metrics(finished_run)]
    assert same_weights(model_weights(out / "final"), model_weights(finished_run / "final"))
    assert same_weights(model_weights(out / "checkpoints" / "step-3"),
                        model_weights(finished_run / "checkpoints" / "step-3")), "the torn folder was replaced"


def test_no_loadable_checkpoint_is_an_error_naming_the_file(finished_run, tiny_model_dir, recipe, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    for checkpoint in complete_checkpoints(out):
        truncate(checkpoint / "model.safetensors")
    before = {k: v for k, v in snapshot(out).items() if k != "config.yaml"}
    assert train(recipe, tiny_model_dir, out, "--resume", **{"train.max_steps": 6}) == 2
    message = grpo_message(capsys.readouterr().err)
    newest = out / "checkpoints" / "step-4" / "model.safetensors"
    assert message.startswith("grpo: checkpoint error: no checkpoint in") and f"{newest} cannot be read" in message
    assert {k: v for k, v in snapshot(out).items() if k != "config.yaml"} == before, \
        "a failed resume must not start the run over (metrics, checkpoints untouched)"


def test_resume_from_another_runs_checkpoint_starts_a_new_run_from_it(finished_run, tiny_model_dir, recipe,
                                                                       tmp_path, capsys):
    """train.resume_from naming another run's checkpoint: a new run in output_dir (guarded as one) that trains
    steps 3 and 4 from step 2's state, as the finished run did; the source run is left as it was."""
    before = snapshot(finished_run)
    source = finished_run / "checkpoints" / "step-2"
    out = tmp_path / "continued"
    assert train(recipe, tiny_model_dir, out, **{"train.max_steps": 4, "train.save_total_limit": None,
                                                 "train.resume_from": str(source)}) == 0
    assert [r["step"] for r in train_rows(out)] == [3, 4]
    assert same_weights(model_weights(out / "final"), model_weights(finished_run / "final"))
    assert snapshot(finished_run) == before
    capsys.readouterr()
    assert train(recipe, tiny_model_dir, out, **{"train.resume_from": str(source)}) == 2  # out holds a run now
    assert "already holds a run" in grpo_message(capsys.readouterr().err)


# ---------------------------------------------------------------- another run's folder


def test_folder_of_another_run_is_refused_unless_resume_or_overwrite(finished_run, tiny_model_dir, recipe, tmp_path,
                                                                     capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = snapshot(out)
    assert train(recipe, tiny_model_dir, out) == 2
    message = grpo_message(capsys.readouterr().err)
    assert message.startswith(f"grpo: configuration error: train.output_dir: {out} already holds a run"), message
    assert "--resume" in message and "--overwrite" in message
    assert snapshot(out) == before

    assert train(recipe, tiny_model_dir, tmp_path / "empty", "--resume") == 2
    assert "holds no run to resume" in grpo_message(capsys.readouterr().err)
    assert not (tmp_path / "empty").exists()

    assert train(recipe, tiny_model_dir, out, "--overwrite", **{"train.max_steps": 1}) == 0
    assert [r["step"] for r in train_rows(out)] == [1]
    assert [p.name for p in complete_checkpoints(out)] == ["step-1"], "the old run's checkpoints are gone"
