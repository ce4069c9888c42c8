"""The small K&K model of configs/kk-demo-cpu.yaml and the script that builds it (scripts/build_tiny_kk_model.py).

(a) ``--quick`` still builds a working model (so the script cannot rot): it loads with plain
    ``from_pretrained``, its tokenizer keeps the trace and the answer short, its report has every
    figure docs/guides/tasks.md quotes, and its completions are in the format the ``kk`` task scores.
(b) The shipped build (``assets/tiny-kk``): its report belongs to the demo recipe's held-out set and
    leaves the planted headroom GRPO is meant to remove, and the weights reproduce the report's greedy
    accuracy (so a rebuilt model cannot ship with a stale report).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSET = REPO_ROOT / "assets" / "tiny-kk"
SCRIPT = REPO_ROOT / "scripts" / "build_tiny_kk_model.py"
DEMO_RECIPE = REPO_ROOT / "configs" / "kk-demo-cpu.yaml"
METRICS = {"n", "accuracy", "format_rate", "truncated_rate", "pass@8", "mean_sample_accuracy", "sample_format_rate",
           "greedy_shortcut_rate", "sample_shortcut_rate", "sample_accuracy_when_checked",
           "checked_greedy_accuracy"}

# The --quick build: 150 SFT steps of 16 two-person puzzles on a CPU (~4 min on one thread). Too short
# for the logic; what it checks is that the chat format and the answer lines are learned (measured:
# format 100%, 91% of samples) and the loss fell well below its start (6.63 -> 0.60 measured; a broken
# target or masking would leave it near the start).
QUICK_MIN_FORMAT_RATE = 0.80
QUICK_MAX_LOSS_RATIO = 0.35


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("kk") / "tiny-kk"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)], check=True,
                   cwd=REPO_ROOT, timeout=1800)
    return out


def test_quick_build_writes_a_loadable_model_and_a_complete_report(quick_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(quick_build)
    tokenizer = AutoTokenizer.from_pretrained(quick_build)
    assert isinstance(model, Qwen2ForCausalLM) and tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert sum(f.stat().st_size for f in quick_build.iterdir()) < 15 * 2**20
    # Names, roles and the trace's letters are one token each, so a 3-person answer stays short.
    completion = "<think>\nZoey K Oliver N = T F ok\n</think>\n<answer>\n(1) Zoey is a knight\n(2) Oliver is a knave\n</answer>"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(completion, add_special_tokens=False)["input_ids"])
    for token in ("<think>", "</answer>", "ĠZoey", "ĠOliver", "Ġknight", "Ġknave", "ĠK", "ĠN", "ĠT", "ĠF", "Ġok"):
        assert token in tokens, (token, tokens)
    assert len(tokens) <= 40, tokens

    report = json.loads((quick_build / "build_report.json").read_text())
    held_out = report["held_out"]
    assert METRICS <= set(held_out) and held_out["n"] == 50 and held_out["temperature"] == 1.0
    assert set(held_out["by_people"]) == {"people=2"}
    assert all(METRICS <= set(row) for row in held_out["by_people"].values())
    assert held_out["data"] == report["settings"]["eval_data"] == "kk:seed=123,n=50,people=2-2"
    assert report["training"]["steps"] == 150 and 1_000_000 < report["params"] < 5_000_000


def test_quick_build_learns_the_answer_format(quick_build):
    report = json.loads((quick_build / "build_report.json").read_text())
    held_out = report["held_out"]
    assert held_out["format_rate"] >= QUICK_MIN_FORMAT_RATE, held_out
    assert held_out["sample_format_rate"] >= QUICK_MIN_FORMAT_RATE - 0.2, held_out
    history = report["training"]["history"]
    assert history[-1]["loss"] < QUICK_MAX_LOSS_RATIO * history[0]["loss"], history
    # The greedy completion of the first held-out puzzle is well formatted for the kk task and answers in
    # its numbered lines, one per person (right or wrong: 150 steps do not teach the logic).
    from grpo.data import load_dataset_source
    from grpo.rewards.answers import extract_answer
    from grpo.tasks import resolve_task
    from grpo.data.knights_knaves.text import solution_roles

    (example,) = load_dataset_source(held_out["data"], limit=1)
    completion = held_out["example_completion"]
    assert resolve_task("kk").score(completion, example.answer, "think")["formatted"], completion
    lines = extract_answer(completion, "think").strip().splitlines()
    assert len(lines) == len(solution_roles(example.answer)), completion
    assert all(re.fullmatch(rf"\({i}\) \w+ is a (knight|knave)", line) for i, line in enumerate(lines, start=1)), completion


def test_shipped_build_matches_the_demo_and_leaves_headroom():
    report = json.loads((ASSET / "build_report.json").read_text())
    held_out = report["held_out"]
    demo = yaml.safe_load(DEMO_RECIPE.read_text())
    assert held_out["data"] == demo["data"]["eval"] == report["settings"]["eval_data"]
    assert demo["model"]["name_or_path"] == "assets/tiny-kk" and demo["data"]["task"] == "kk"
    assert held_out["format_rate"] > 0.9
    # Greedy takes the planted shortcut, sampling avoids it often, and greedy past the shortcut is right
    # often enough that GRPO, by removing it, can gain the demo's 15 points.
    assert held_out["greedy_shortcut_rate"] > 0.5 and held_out["sample_shortcut_rate"] < 0.8
    assert held_out["checked_greedy_accuracy"] - held_out["accuracy"] >= 0.15, held_out
    assert report["training"]["steps"] == 1200 and report["settings"]["seed"] == 0


def test_shipped_model_reproduces_its_reported_greedy_accuracy():
    # Greedy decoding is deterministic: the first 100 held-out puzzles must score what the report says
    # for them, within a few puzzles (CPU kernels may flip a near-tie).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.data import load_dataset_source
    from grpo.tasks import resolve_task
    from grpo.evaluation.evaluate import evaluate

    report = json.loads((ASSET / "build_report.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(ASSET)
    examples = load_dataset_source(report["held_out"]["data"], limit=100)
    result = evaluate(model, tokenizer, examples, task=resolve_task("kk"), batch_size=100,
                      max_new_tokens=report["settings"]["eval_max_new_tokens"], progress=False)
    assert result["format_rate"] > 0.9
    assert abs(result["accuracy"] - report["held_out"]["first_100_accuracy"]) <= 0.03, result
