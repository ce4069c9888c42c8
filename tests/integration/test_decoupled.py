"""Decoupled mode end to end with real processes: sampler(s), trainer ranks (DDP / DeepSpeed), ref server."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from run_helpers import (
    REPO,
    SMOKE,
    cli_env,
    colocated_and_decoupled,
    decoupled_overrides,
    each_batch_once,
    free_port,
    grpo_cmd,
    logged_steps,
    read_metrics,
    start,
    stop_all,
    train_rows,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from grpo.models.tiny import build_qwen2

    path = tmp_path_factory.mktemp("teacher")
    build_qwen2(tiny_tokenizer, hidden_size=96, num_layers=3, seed=5).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_first_step_equals_colocated(tiny_model_dir, teacher_dir, tmp_path):
    # Same seeds, max_staleness 0, 2 trainer ranks, a teacher reference (so the KL term is not 0):
    # colocated (torchrun) and decoupled (sampler + 2 trainer ranks + ref server) give the same first step.
    # Both evaluate two named sets over their 2 ranks (decoupled: the trainer ranks, through an engine over
    # their own policy) and keep the best checkpoint: the same numbers before training.
    common = {"model.ref_name_or_path": teacher_dir, "loss.beta": 0.1, "train.max_steps": 2,
              "data.eval": "{a: 'synthetic:seed=9,n=6', b: 'synthetic:seed=10,n=5'}", "eval.num_samples": 2,
              "train.eval_steps": 1, "train.best_metric": "eval/a/reward/total"}
    colocated, decoupled = colocated_and_decoupled(tiny_model_dir, tmp_path, common, {
        "decoupled.trainer_ranks": 2, "decoupled.ref_server": True, "decoupled.ref_server_port": free_port()})
    evals = {out: {r["step"]: r for r in read_metrics(out) if "eval/a/accuracy" in r} for out in (colocated, decoupled)}
    assert sorted(evals[decoupled]) == [0, 1, 2] and "eval/b/pass@2" in evals[decoupled][0]
    before = [{k: v for k, v in evals[out][0].items() if k.startswith("eval/")} for out in (colocated, decoupled)]
    assert before[0] == before[1]
    for name in ("a", "b"):
        records = [(out / "eval" / "step_0" / f"{name}.jsonl").read_text() for out in (colocated, decoupled)]
        assert records[0] == records[1]
    assert json.loads((decoupled / "best" / "best.json").read_text())["metric"] == "eval/a/reward/total"
    a, b = train_rows(colocated)[0], train_rows(decoupled)[0]
    assert a["kl"] > 1e-4  # the teacher differs from the policy: a real KL term
    for key in ("loss", "kl", "reward/mean", "reward/std", "accuracy", "completion_length/mean"):
        assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert [r["step"] for r in train_rows(decoupled)] == [1, 2]
    assert (decoupled / "weights").is_dir() and (decoupled / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_new_estimator_and_loss_settings_reach_every_rank_and_two_samplers_share_the_steps(tiny_model_dir, tmp_path,
                                                                                           mini_batches):
    # rloo advantages (the sampler's), GSPO ratios over two iterations and the entropy (the trainer ranks'):
    # colocated over 2 ranks and decoupled with 2 trainer ranks must log the same steps. Two samplers share
    # each step's chunks (whichever makes which): at max_staleness 0 the run is still the colocated one. With
    # train.mini_batches 2 each rank's 2 groups are 2 updates a pass, their old log-probs the sampler's (decoupled)
    # or the trainer's own before its first update (colocated): the same steps still.
    common = {"algorithm.advantage_estimator": "rloo", "loss.importance_sampling_level": "sequence",
              "loss.num_iterations": 2, "loss.beta": 0.0, "train.max_steps": 2, "train.mini_batches": mini_batches}
    colocated, decoupled = colocated_and_decoupled(tiny_model_dir, tmp_path, common,
                                                   {"decoupled.trainer_ranks": 2, "decoupled.num_samplers": 2})
    for a, b in zip(train_rows(colocated), each_batch_once(decoupled, 2), strict=True):
        assert a["advantage/abs_mean"] > 0 and a["entropy"] > 0 and a["ratio_mean"] != 1.0
        for key in ("loss", "advantage/abs_mean", "entropy", "ratio_mean", "clip_fraction", "reward/mean"):
            assert abs(a[key] - b[key]) < 1e-5, (a["step"], key, a[key], b[key])
        assert b["batch_id"] == f"step-{b['step']}/rank-0,step-{b['step']}/rank-1"
        assert set(b["sampler_id"].split(",")) <= {"sampler-0", "sampler-1"}


@pytest.fixture(scope="module")
def zero_run(tiny_model_dir, tmp_path_factory):
    """``zero_run(stage, fused=False)``: the run folder of a 2-step decoupled run with 2 trainer ranks under ZeRO
    ``stage`` (checkpoint every step), made once per module: the stage-3 run is both the checkpoint test's and the
    fused head's reference."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (make install installs it)")
    runs: dict[tuple[int, bool], Path] = {}

    def run(stage: int, fused: bool = False) -> Path:
        if (stage, fused) not in runs:
            out = tmp_path_factory.mktemp(f"zero{stage}-fused-{fused}") / "run"
            cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, out, **{
                "train.mode": "decoupled", "decoupled.trainer_ranks": 2, "train.max_steps": 2, "train.save_steps": 1,
                "train.deepspeed": REPO / "configs" / f"ds_zero{stage}.json", "train.fused_lm_head": fused}))
            result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[stage, fused] = out
        return runs[stage, fused]

    return run


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trainer_ranks(tiny_model_dir, zero_run, stage):
    out = zero_run(stage)
    assert [r["step"] for r in train_rows(out)] == [1, 2]
    assert (out / "checkpoints" / "deepspeed-step-2").is_dir()
    import torch
    from safetensors.torch import load_file

    initial = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")  # gathered from the shards under ZeRO-3
    assert set(initial) == set(final)
    assert any(not torch.equal(initial[k], final[k]) for k in initial), "training changed the weights"
    published = load_file(out / "weights" / "v2" / "model.safetensors")
    differ = {k: float((published[k].float() - final[k].float()).abs().max()) for k in published
              if not torch.equal(published[k], final[k])}
    assert not differ, f"weights v2 (published after step 2) differ from final/ (max abs diff per tensor): {differ}"


def test_zero3_fused_lm_head_trains_as_the_logits_pass(zero_run):
    # the fused head's chunks call the head module itself, so ZeRO-3 gathers its shards per chunk and again
    # for the recompute in backward: the same losses as the whole-logits pass, step by step
    rows = {fused: train_rows(zero_run(3, fused)) for fused in (False, True)}
    assert len(rows[True]) == len(rows[False]) == 2
    for a, b in zip(rows[False], rows[True]):
        for key in ("loss", "kl", "entropy", "grad_norm", "reward/mean"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


def finish(trainer: subprocess.Popen, sampler: subprocess.Popen) -> None:
    """Wait for the trainer to finish cleanly; its bye ends the sampler."""
    _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err[-3000:]
    sampler.wait(timeout=120)


def test_sampler_killed_and_restarted(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = decoupled_overrides(tiny_model_dir, out, **{"train.max_steps": 8, "train.mode": "decoupled"})
    trainer, sampler = start("trainer", SMOKE, *args, stderr=subprocess.PIPE), start("sampler", SMOKE, *args)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "2 logged steps", timeout=240, proc=trainer)
        sampler.send_signal(signal.SIGKILL)  # mid-chunk, or waiting for work while the trainer trains
        sampler.wait()
        assert sampler.returncode == -signal.SIGKILL, f"the sampler exited with {sampler.returncode} before the kill"
        sampler = start("sampler", SMOKE, *args)
        finish(trainer, sampler)
    finally:
        stop_all(trainer, sampler)
    each_batch_once(out, 8)


def test_one_of_two_samplers_killed_the_other_finishes_the_run(tiny_model_dir, tmp_path, monkeypatch):
    # The killed sampler's chunk (if it held one) goes to the other once it has been silent for LOST_AFTER_S;
    # every step is trained once, from chunks of that step.
    # Two trainer ranks, as every failure row of docs/guides/reliability.md is tested: each step is two chunks.
    import sys

    out = tmp_path / "run"
    args = decoupled_overrides(tiny_model_dir, out, **{"train.max_steps": 6, "train.mode": "decoupled",
                                                       "decoupled.trainer_ranks": 2, "decoupled.num_samplers": 2})
    trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", str(free_port()), "-m", "grpo", "trainer", SMOKE, *map(str, args)],
                               env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samplers = [start("sampler", SMOKE, *args, f"decoupled.sampler_index={k}") for k in (0, 1)]
    try:
        wait_until(lambda: logged_steps(out) >= 2, "2 logged steps", timeout=240, proc=trainer)
        samplers[0].send_signal(signal.SIGKILL)
        samplers[0].wait()
        finish(trainer, samplers[1])
        assert samplers[1].returncode == 0
    finally:
        stop_all(trainer, *samplers)
    rows = each_batch_once(out, 6)
    assert [r["batch_id"] for r in rows] == [f"step-{s}/rank-0,step-{s}/rank-1" for s in range(1, 7)]
    assert rows[-1]["sampler_id"] == "sampler-1"
    # The killed sampler started again after the run (here, in this process): the trainer marked the run folder
    # finished, so once no trainer answers it exits 0, instead of trying for decoupled.peer_timeout_s and failing.
    from grpo.config.resolve import load_config
    from grpo.decoupled import sampler_role

    assert json.loads((out / "decoupled" / "trainer_address.json").read_text())["finished"]["step"] == 6
    monkeypatch.setattr(sampler_role, "RECONNECT_S", 1.0)
    assert sampler_role.run_sampler(load_config(SMOKE, [*map(str, args), "decoupled.sampler_index=0"])) == 0


@pytest.mark.parametrize("save_steps", [1, 3])
def test_trainer_killed_and_resumed(tiny_model_dir, tmp_path, save_steps):
    # save_steps 3: the kill lands after step 5, two steps past the checkpoint; those steps' batches were
    # acknowledged provisionally, so the sampler still holds them, resends them, and they are trained
    # again after the resume: no acknowledged batch is lost and none is trained twice in the final run.
    from grpo.run.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    settings = {"train.max_steps": 8, "train.save_steps": save_steps, "train.mode": "decoupled"}
    args = decoupled_overrides(tiny_model_dir, out, **settings)
    trainer, sampler = start("trainer", SMOKE, *args), start("sampler", SMOKE, *args, stderr=subprocess.PIPE)
    try:
        steps = 3 if save_steps == 1 else 5
        wait_until(lambda: logged_steps(out) >= steps, f"{steps} logged steps", timeout=240, proc=trainer)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        assert trainer.returncode == -signal.SIGKILL, f"the trainer exited with {trainer.returncode} before the kill"
        before_kill = {r["batch_id"] for r in train_rows(out)}
        state = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())
        trained_before = set(state["trained_batch_ids"])
        trainer = start("trainer", SMOKE, *args, "train.resume=true", stderr=subprocess.PIPE)
        finish(trainer, sampler)
        assert sampler.returncode == 0
    finally:
        stop_all(trainer, sampler)
    rows = each_batch_once(out, 8)
    resumed_ids = {r["batch_id"] for r in rows if r["step"] > state["step"]}
    assert not resumed_ids & trained_before
    assert before_kill <= {r["batch_id"] for r in rows}, "a batch trained (and acknowledged) before the kill was lost"
    if save_steps == 3:
        # On-policy (max_staleness 0) with fixed seeds, the killed-and-resumed run is the uninterrupted one.
        clean = tmp_path / "uninterrupted"
        clean_args = decoupled_overrides(tiny_model_dir, clean, **settings)
        trainer = start("trainer", SMOKE, *clean_args, stderr=subprocess.PIPE)
        sampler = start("sampler", SMOKE, *clean_args)
        try:
            finish(trainer, sampler)
        finally:
            stop_all(trainer, sampler)
        for resumed, uninterrupted in zip(rows, train_rows(clean), strict=True):
            assert resumed["batch_id"] == uninterrupted["batch_id"]
            for key in ("loss", "reward/mean", "kl", "grad_norm", "completion_length/mean"):
                assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-5), (resumed["step"], key)


def test_broadcast_weight_sync_gives_the_files_run(tiny_model_dir, tmp_path):
    # Two samplers on-policy (max_staleness 0) take weights versions 1 and 2 by broadcast: the run must log
    # what the same run with weights through files logs (the same bits arrive either way).
    runs = {}
    for sync in ("files", "broadcast"):
        out = tmp_path / sync
        cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, out, **{
            "train.mode": "decoupled", "decoupled.num_samplers": 2, "train.max_staleness": 0, "loss.beta": 0.1,
            "decoupled.weight_sync": sync, "decoupled.weight_sync_port": free_port()}))
        result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[sync] = (each_batch_once(out, 3), result.stderr)
    (files, _), (broadcast, log) = runs["files"], runs["broadcast"]
    assert "weights version 2 broadcast to 2 samplers" in log and "weight broadcast failed" not in log, log[-3000:]
    assert files[-1]["kl"] > 0  # the policy moved away from the reference: a real KL term from step 2
    for a, b in zip(files, broadcast, strict=True):
        for key in ("loss", "reward/mean", "kl"):
            assert abs(a[key] - b[key]) < 1e-6, (a["step"], key, a[key], b[key])


def test_multi_turn_tool_rollouts_equal_colocated_over_two_ranks(tmp_path):
    # The calculator on the tiny tool model: the multi-turn records (loss_mask, messages, tool metrics) cross
    # the wire to 2 trainer ranks and give the steps colocated torchrun (2 ranks) gives.
    common = {"data.train": "arithmetic-tools:seed=5,n=64,size=large", "rollout.max_completion_length": 96,
              "rollout.tools": "[grpo.multiturn.calculator:calculator]", "rollout.max_tool_calling_iterations": 1,
              "train.max_steps": 2, "rollout.num_generations": 8}
    colocated, decoupled = colocated_and_decoupled(REPO / "assets" / "tiny-tools", tmp_path, common,
                                                   {"decoupled.trainer_ranks": 2})
    rows = train_rows(colocated)
    assert sum(r["tools/calls_per_completion"] for r in rows) > 0
    for a, b in zip(rows, each_batch_once(decoupled, 2), strict=True):
        for key in ("loss", "reward/mean", "tools/calls_per_completion", "tools/failure_rate", "tools/turns",
                    "sampled_length/mean", "completion_length/mean", "entropy"):
            assert abs(a[key] - b[key]) < 1e-5, (a["step"], key, a[key], b[key])


def test_the_launcher_stops_on_sigint_even_started_with_sigint_ignored(tiny_model_dir, tmp_path):
    # `grpo train ... &` from a script: the shell starts it with SIGINT ignored (and its roles inherit that);
    # `kill -INT` must still stop the run with its last step saved, not leave the launcher and its roles running
    # or have the trainer killed after the grace period, unsaved, for ignoring the launcher's SIGINT.
    out = tmp_path / "run"
    overrides = decoupled_overrides(tiny_model_dir, out, **{"train.mode": "decoupled", "train.max_steps": 1000,
                                                            "decoupled.num_samplers": 1})
    launcher = subprocess.Popen(grpo_cmd("train", str(SMOKE), *overrides), env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two steps", proc=launcher)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130
        assert logged_steps(out) < 1000
        assert list((out / "checkpoints").glob("step-*")), "the trainer saved its last step"
    finally:
        stop_all(launcher)
