"""scripts/build_tiny_rg_model.py: the SFT targets are tiny-math's chain format for reasoning-gym's chain_sum
wording (a planted share of two-step chains stopping after step one), and a short build from the shipped tiny-math writes a model whose weights moved and that loads."""

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


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import build_tiny_rg_model
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return build_tiny_rg_model


def _chain(expression: str) -> list[str]:
    """A plain reference: each step's line, left to right."""
    tokens, lines = expression.split(), []
    value = int(tokens[0])
    for i in range(1, len(tokens), 2):
        new = value + int(tokens[i + 1]) if tokens[i] == "+" else value - int(tokens[i + 1])
        lines.append(f"{value} {tokens[i]} {tokens[i + 1]} = {new}")
        value = new
    return lines


def test_the_targets_are_the_chain_and_its_value_or_the_planted_first_step():
    script = _script()
    examples = load_dataset_source(f"reasoning_gym:{script.TRAIN_TASK},size=40,seed=4")
    assert {len(e.question.split(":", 1)[1].split()) for e in examples} == {4, 6}  # two and three terms
    for example in examples:
        lines = _chain(example.question.rsplit(":", 1)[1].strip().rstrip("=").strip())
        value = lines[-1].rsplit(" ", 1)[1]
        assert value == example.answer_raw
        full = "\n".join(lines)
        assert script.completion_text(example, planted=False) == f"<think>\n{full}\n</think>\n<answer>\n{value}\n</answer>"
        first = lines[0].rsplit(" ", 1)[1]
        assert script.completion_text(example, planted=True) == \
            f"<think>\n{lines[0]}\n</think>\n<answer>\n{first}\n</answer>"


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
