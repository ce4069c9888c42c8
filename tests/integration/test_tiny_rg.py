"""scripts/build_tiny_rg_model.py: the SFT targets are tiny-math's one-step format for reasoning-gym's chain_sum
wording, and a short build from the shipped tiny-math writes a model whose weights moved and that loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.data import load_dataset_source

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_tiny_rg_model.py"


def test_the_targets_are_the_one_step_chain_and_its_value():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from build_tiny_rg_model import TRAIN_TASK, completion_text
    finally:
        sys.path.remove(str(SCRIPT.parent))
    for example in load_dataset_source(f"reasoning_gym:{TRAIN_TASK},size=20,seed=4"):
        a, op, b = example.question.rsplit(":", 1)[1].strip().rstrip("=").split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert completion_text(example) == f"<think>\n{a} {op} {b} = {value}\n</think>\n<answer>\n{value}\n</answer>"


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_build_moves_the_weights_and_writes_its_report(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tiny-rg"
    subprocess.run([sys.executable, str(SCRIPT), "--steps", "3", "--out", str(out)], check=True, cwd=REPO,
                   capture_output=True, timeout=600)
    report = json.loads((out / "build_report.json").read_text())
    assert report["steps"] == 3 and report["base"] == "assets/tiny-math"
    base = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-math").state_dict()
    built = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert base.keys() == built.keys() and any(not torch.equal(base[k], built[k]) for k in base)
