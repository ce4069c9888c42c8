"""kill -9 while a tool call of a multi-turn step is in flight, then --resume: the run equals an uninterrupted
one (metrics but timings, final weights), on assets/tiny-tools with the calculator (issue 27)."""

from __future__ import annotations

import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from run_helpers import cli_env, grpo_cmd, logged_steps, read_metrics, train_rows, wait_until, without_timings
from safetensors.torch import load_file

from grpo.cli import main

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
TINY_TOOLS = Path(__file__).resolve().parents[2] / "assets" / "tiny-tools"
STEPS = 6
RECIPE = f"""\
model: {{name_or_path: {TINY_TOOLS}}}
data: {{train: 'arithmetic-tools:seed=5,n=64,size=large', tag_style: think}}
rollout:
  num_generations: 8
  max_completion_length: 96
  tools: ['tools_for_reliability:calculator']
  max_tool_calling_iterations: 1
optim: {{learning_rate: 1.0e-4}}
train: {{prompts_per_step: 2, micro_batch_size: 8, max_steps: {STEPS}, save_steps: 1, seed: 4}}
log: {{report_to: [], progress_bar: false, plots: false, logging_steps: 1}}
rewards: [{{name: answer_correct}}]
"""


def calls(marker: Path) -> int:
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def test_kill_9_during_a_tool_call_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    recipe = tmp_path / "tools.yaml"
    recipe.write_text(RECIPE)
    monkeypatch.setenv("GRPO_TEST_TOOL_MARKER", str(tmp_path / "reference-calls.txt"))
    reference = tmp_path / "uninterrupted"
    assert main(["train", str(recipe), f"train.output_dir={reference}"]) == 0
    assert sum(r["tools/calls_per_completion"] for r in train_rows(reference)) > 0

    out, marker = tmp_path / "killed", tmp_path / "calls.txt"
    args = [str(recipe), f"train.output_dir={out}"]
    env = {**cli_env(), "GRPO_TEST_TOOL_MARKER": str(marker)}
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(grpo_cmd("train", *args), env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                text=True)
        try:
            # after a step is checkpointed, the next tool call (sleeping 0.3 s) is a multi-turn step in flight
            wait_until(lambda: logged_steps(out) >= 1, "a logged step", proc=proc)
            seen = calls(marker)
            wait_until(lambda: calls(marker) > seen, "a tool call after step 1", proc=proc)
            steps_then = logged_steps(out)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        stderr.seek(0)
        assert proc.returncode == -signal.SIGKILL, stderr.read()[-2000:]
    assert steps_then < STEPS, "the run finished before the kill"
    assert main(["train", *args, "--resume"]) == 0

    assert [r["step"] for r in train_rows(out)] == list(range(1, STEPS + 1)), "a step was lost or trained twice"
    assert [without_timings(r) for r in read_metrics(out)] == [without_timings(r) for r in read_metrics(reference)]
    a, b = load_file(reference / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
