"""Evaluation inside a run, end to end on the tiny model: named eval sets logged and their records written each
evaluation, ``best/`` holding the weights of the evaluation with the best logged metric, and a 2-rank run whose
evaluation (sharded over the ranks, records gathered) gives the 1-rank run's numbers and records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import REPO, SIGNAL_REWARDS, base_overrides, cli_env, read_metrics
from safetensors.torch import load_file
from transport_helpers import free_port

from grpo.config import load_config
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVAL_SETS = "{a: 'synthetic:seed=9,n=6', b: 'synthetic:seed=10,n=5'}"


def same_weights(folder_a: Path, folder_b: Path) -> bool:
    a, b = load_file(folder_a / "model.safetensors"), load_file(folder_b / "model.safetensors")
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_named_sets_records_and_best_checkpoint(tmp_path):
    # tiny-math, not the random tiny model (whose greedy completions are all newlines): its greedy completions,
    # and so their share of letters, move as a large learning rate moves its weights
    out, model = tmp_path / "run", REPO / "assets" / "tiny-math"
    cfg = load_config(None, base_overrides(model, out, **{
        "data.train": "synthetic:seed=1,n=64,difficulty=demo", "data.eval": EVAL_SETS, "train.eval_steps": 1,
        "train.save_steps": 1, "train.save_total_limit": "null", "rollout.max_completion_length": 24,
        "rewards": SIGNAL_REWARDS, "train.best_metric": "eval/a/reward/letters", "eval.num_samples": 2,
        "eval.max_samples_written": 1, "optim.learning_rate": 3e-3}))
    result = train(cfg)
    assert result.eval_before is not None and "pass@2" in result.eval_before  # the first set's metrics
    evals = {r["step"]: r for r in read_metrics(out) if "eval/a/accuracy" in r}
    assert sorted(evals) == [0, 1, 2, 3]
    for row in evals.values():
        for name in ("a", "b"):
            for key in ("accuracy", "format_rate", "pass@2", "maj@2", "reward/letters", "reward/total"):
                assert f"eval/{name}/{key}" in row
        assert "eval/accuracy" not in row  # named sets only
    for step in evals:
        for name, size in (("a", 6), ("b", 5)):
            rows = [json.loads(line) for line in (out / "eval" / f"step_{step}" / f"{name}.jsonl").read_text().splitlines()]
            assert len(rows) == size and all(len(r["sample_completions"]) == 1 for r in rows)
            assert sum(r["rewards"]["letters"] for r in rows) / size == pytest.approx(evals[step][f"eval/{name}/reward/letters"])
    values = {step: row["eval/a/reward/letters"] for step, row in evals.items()}
    assert len(set(values.values())) > 1, "the metric should move for this test to mean something"
    best_step = max(values, key=lambda s: (values[s], -s))  # the first of the highest
    saved = json.loads((out / "best" / "best.json").read_text())
    assert saved == {"step": best_step, "metric": "eval/a/reward/letters", "value": values[best_step]}
    weights_of = {0: model, **{s: out / "checkpoints" / f"step-{s}" for s in (1, 2, 3)}}
    assert same_weights(out / "best", weights_of[best_step])
    assert not same_weights(out / "best", weights_of[next(s for s in values if s != best_step)])


def test_two_ranks_evaluate_as_one(tiny_model_dir, tmp_path):
    """Each rank evaluates a contiguous slice of each set; the gathered records give the 1-rank numbers (before
    training, where the two runs' weights are the same)."""
    common = {"data.eval": EVAL_SETS, "train.max_steps": 1, "train.prompts_per_step": 2, "eval.num_samples": 2,
              "eval.batch_size": 4, "eval.bootstrap": 20}
    outs = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), "-m", "grpo", "train", *base_overrides(tiny_model_dir, out, **common)]
        done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outs[ranks] = out

    def step0(out: Path) -> dict:
        (row,) = [r for r in read_metrics(out) if r["step"] == 0 and "eval/a/accuracy" in r]
        return {k: v for k, v in row.items() if k.startswith("eval/")}

    one, two = step0(outs[1]), step0(outs[2])
    assert "eval/b/pass@2" in one and "eval/a/accuracy_ci_low" in one
    assert two == one
    for name in ("a", "b"):
        records = [(outs[r] / "eval" / "step_0" / f"{name}.jsonl").read_text() for r in (1, 2)]
        assert records[0] == records[1]
