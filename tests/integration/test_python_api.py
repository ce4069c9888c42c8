"""The Python API as a TRL user runs it: examples/grpo_gsm8k_unsloth.py (the Unsloth GSM8K recipe: a
datasets.Dataset mapped into chat prompts and an answer column, the five reward functions, a peft LoRA,
TRL's argument names) with only the import changed, under grpo, under TRL, and under torchrun with 2 ranks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "grpo_gsm8k_unsloth.py"
REWARDS = ("xmlcount_reward_func", "soft_format_reward_func", "strict_format_reward_func", "int_reward_func",
           "correctness_reward_func")


def run_script(out: Path, *extra: str, launcher: tuple[str, ...] = (), logs: Path | None = None) -> list[dict]:
    """The script's printed log_history (one dict per line; TRL's own console dicts have no step); under a
    launcher whose ranks write their output to ``logs`` (one stdout.log per rank), read rank by rank there: the
    ranks' prints share one pipe otherwise, and an unbuffered print may land in the middle of another's line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*(launcher or (sys.executable,)), str(SCRIPT), "--max-steps", "2",
                             "--output-dir", str(out), *extra],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [f.read_text() for f in sorted(logs.rglob("stdout.log"))] if logs else [result.stdout]
    entries = [ast.literal_eval(line) for text in outputs for line in text.splitlines() if line.startswith("{")]
    return [e for e in entries if "step" in e]


def check_adapter(folder: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-math"), folder)


def test_the_unsloth_script_runs_with_only_the_import_changed(tmp_path):
    history = run_script(tmp_path / "grpo")
    steps = [e for e in history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for name in REWARDS:
        assert all(f"rewards/{name}/mean" in e for e in steps), name
    check_adapter(tmp_path / "grpo" / "final")
    pytest.importorskip("trl")
    trl_steps = [e for e in run_script(tmp_path / "trl", "--trl") if "loss" in e]
    assert [e["step"] for e in trl_steps] == [1, 2]
    shared = set(steps[0]) & set(trl_steps[0])
    assert {f"rewards/{name}/mean" for name in REWARDS} | {"reward", "reward_std", "loss", "entropy"} <= shared
    check_adapter(tmp_path / "trl" / "final")


@pytest.mark.slow
def test_the_same_script_trains_data_parallel_under_torchrun(tmp_path):
    history = run_script(tmp_path / "ddp", launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                     "2", "--log-dir", str(tmp_path / "logs"), "--redirects", "1"),
                         logs=tmp_path / "logs")
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 1, 2]  # each rank prints its log_history
    check_adapter(tmp_path / "ddp" / "final")
