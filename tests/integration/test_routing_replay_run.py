"""`grpo train` with loss.routing_replay on a tiny Qwen3-MoE policy: the rollout records its routing, the old-policy
pass of a later mini-batch and every update pass replay it (under gradient checkpointing, whose recompute routes
as the forward did), and moe/routing_mismatch says how often the update would have routed otherwise; with
log.routing_mismatch the same is measured without replaying."""

from __future__ import annotations

import json

import pytest
from architectures import FAMILIES
from run_helpers import as_overrides

from grpo.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("key", ["loss.routing_replay", "log.routing_mismatch"])
def test_a_replayed_run_trains_and_logs_how_often_the_update_would_have_routed_otherwise(tiny_tokenizer, tmp_path, key):
    FAMILIES["qwen3_moe"].build(tiny_tokenizer).save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    assert main(["train", *as_overrides({
        "model.name_or_path": str(tmp_path / "model"), "data.train": "synthetic:seed=1,n=16", "data.eval": None,
        "rollout.num_generations": 4, "rollout.max_completion_length": 6, "train.prompts_per_step": 2,
        "train.micro_batch_size": 2, "train.max_steps": 2, "train.save_steps": 100, "train.output_dir": str(out),
        "optim.learning_rate": 1e-2, "log.report_to": "[]", "log.progress_bar": False, "log.plots": False,
        "rewards": "[{name: 'rewards_for_tests:letters'}]", key: True, "loss.num_iterations": 2,
        "train.mini_batches": 2, "model.gradient_checkpointing": True})]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mismatch = [row["moe/routing_mismatch"] for row in rows if "moe/routing_mismatch" in row]
    assert len(mismatch) == 2 and all(0 < m < 1 for m in mismatch)  # 4 updates a step move the router


@pytest.mark.slow
def test_a_decoupled_run_with_partial_rollouts_replays_the_routing_its_sampler_sent(tmp_path):
    # The shipped tiny MoE on one- to three-step problems: completions end at different lengths, so groups are
    # carried from chunk to chunk (their rows' routing with them) and the trainer replays what crossed the wire.
    from run_helpers import REPO, partial_in_flight_run

    rows = partial_in_flight_run(REPO / "assets" / "tiny-moe", tmp_path / "run", 3, **{
        "rollout.engine": "hf", "decoupled.inflight_check_tokens": 4, "optim.learning_rate": 1e-4,
        "loss.routing_replay": True, "loss.num_iterations": 2})
    assert any(r["rollout/partial_groups_carried"] > 0 for r in rows)  # some routing was carried over
    assert all(0 <= r["moe/routing_mismatch"] < 1 for r in rows)  # every update replayed a recorded routing
