"""A sampler killed while it carries unfinished groups (partial rollouts, issue 45), with real processes: when it
restarts, the trainer hands the groups it held to the next sampler given a chunk, which makes them from the start;
each is trained once. The bookkeeping without processes: tests/test_orphan_groups.py."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest
from run_helpers import REPO, SMOKE, decoupled_overrides, each_batch_once, start, stop_all, wait_until

from grpo.run.tracking import METRICS_FILE, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def trained_a_chunk_of(out, sampler_id: str) -> bool:
    """Whether a logged step holds a chunk of ``sampler_id`` (while the run writes its metrics)."""
    try:
        return any(sampler_id in r.get("sampler_id", "").split(",") for r in read_metrics(out / METRICS_FILE))
    except FileNotFoundError:
        return False


def test_a_killed_samplers_carried_groups_are_made_by_another_and_trained_once(tmp_path):
    # min_new_tokens 12 over a budget of 4 tokens a round: a chunk's own groups cannot finish in the chunk that
    # starts them, so a sampler always carries groups when it is killed.
    out, steps = tmp_path / "run", 10
    args = decoupled_overrides(REPO / "assets" / "tiny-math", out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "rollout.max_completion_length": 48,
        "rollout.min_new_tokens": 12, "decoupled.partial_token_budget": 4, "train.max_steps": steps,
        "train.mode": "decoupled", "train.max_staleness": 3, "rollout.engine": "hf", "decoupled.num_samplers": 2,
        "decoupled.partial_rollouts": True, "optim.learning_rate": 1e-5})
    trainer = start("trainer", SMOKE, *args, stderr=subprocess.PIPE)
    samplers = [start("sampler", SMOKE, *args, f"decoupled.sampler_index={k}") for k in (0, 1)]
    try:
        wait_until(lambda: trained_a_chunk_of(out, "sampler-0"), "a step of sampler-0's", timeout=300, proc=trainer)
        samplers[0].send_signal(signal.SIGKILL)
        samplers[0].wait()
        samplers[0] = start("sampler", SMOKE, *args, "decoupled.sampler_index=0")  # a restart: its memory is gone
        _, err = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, err[-3000:]
    finally:
        stop_all(trainer, *samplers)
    adopted = [g for line in re.findall(r"adopts \d+ unsent group\(s\) .*?: (.*)", err) for g in line.split()]
    assert adopted, f"no sampler adopted the killed sampler's groups:\n{err[-3000:]}"
    rows = each_batch_once(out, steps)
    trained = [g for r in rows for g in r.get("groups", "").split()]
    assert len(trained) == len(set(trained)), f"a group was trained twice: {trained}"
    assert set(adopted) & set(trained), f"no adopted group was trained: adopted {adopted}, trained {trained}"
    assert any(r["rollout/partial_groups_adopted"] > 0 for r in rows)
