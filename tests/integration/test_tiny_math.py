"""The embedded default model (assets/tiny-math) and the script that builds it.

(a) The shipped model loads with plain ``from_pretrained``, is a Qwen2 with the tokenizer the demo
    needs, and its build report shows the numbers the docs and the demo rely on; a greedy re-run
    on part of the held-out set agrees with the report (the report belongs to these weights).
(b) ``scripts/build_tiny_math_model.py --quick`` still builds a working model (so the script cannot
    rot): it loads, and on a small held-out set it writes the format and solves some problems.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from grpo.data.sources import load_dataset_source

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSET = REPO_ROOT / "assets" / "tiny-math"
SCRIPT = REPO_ROOT / "scripts" / "build_tiny_math_model.py"
DEMO_RECIPE = REPO_ROOT / "configs" / "demo-cpu.yaml"

# Bands of the task (issue 4) for the full build on the 500 held-out problems.
GREEDY_ACCURACY_BAND = (0.15, 0.45)  # low on purpose: headroom planted for GRPO
MIN_FORMAT_RATE = 0.80
MIN_PASS_AT_8 = 0.70


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ASSET)
    tokenizer = AutoTokenizer.from_pretrained(ASSET)
    return model, tokenizer


def test_shipped_model_is_a_small_qwen2_with_a_math_friendly_tokenizer(shipped):
    from transformers import Qwen2ForCausalLM

    model, tokenizer = shipped
    assert isinstance(model, Qwen2ForCausalLM) and model.config.model_type == "qwen2"
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < params < 5_000_000, params
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 30 * 2**20
    # Digits one per token, whatever the surrounding text.
    for text in ("1234567890", " 98 + 7 = 105", "$4076."):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        digits = [tok for tok in tokenizer.convert_ids_to_tokens(ids) if any(c.isdigit() for c in tok)]
        assert all(len(tok) == 1 for tok in digits), (text, digits)
        assert len(digits) == sum(c.isdigit() for c in text)
    # Tags are single tokens that survive decoding with skip_special_tokens (as the rollout engine decodes).
    completion = "<think>\n3 + 4 = 7\n</think>\n<answer>\n7\n</answer>"
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tokenizer.convert_tokens_to_ids(tag) in ids
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == completion
    # Qwen-style chat: template with a generation prompt, <|im_end|> ends a turn and generation.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id is not None


def test_shipped_build_report_is_in_the_bands_and_matches_the_demo():
    report = json.loads((ASSET / "build_report.json").read_text())
    held_out = report["held_out"]
    demo = yaml.safe_load(DEMO_RECIPE.read_text())
    # The report's 500 problems are those the demo page's figures take from `grpo eval`; the recipe's `demo`
    # set is the first 32 of them.
    assert held_out["data"] == report["settings"]["eval_data"] == "synthetic:seed=123,n=500,difficulty=demo"
    assert demo["data"]["eval"]["demo"] == "synthetic:seed=123,n=32,difficulty=demo"
    assert load_dataset_source(demo["data"]["eval"]["demo"]) == load_dataset_source(held_out["data"])[:32]
    assert held_out["n"] == 500
    assert GREEDY_ACCURACY_BAND[0] <= held_out["accuracy"] <= GREEDY_ACCURACY_BAND[1], held_out["accuracy"]
    assert held_out["format_rate"] > MIN_FORMAT_RATE
    assert held_out["pass@8"] >= MIN_PASS_AT_8 and held_out["temperature"] == 1.0
    # The planted headroom is where it should be: greedy stops early on multi-step problems.
    assert set(held_out["by_steps"]) == {"1-step", "2-step", "3-step"}
    assert held_out["by_steps"]["2-step"]["greedy_stops_after_one_step"] > 0.5
    assert report["wall_seconds"] < 20 * 60


def test_shipped_model_reproduces_its_reported_greedy_accuracy(shipped):
    # Greedy decoding is deterministic: the first 100 held-out problems must score what the report's
    # per-example accuracy implies for them, within a few problems (CPU kernels may flip a tie).
    from grpo.data import load_dataset_source
    from grpo.evaluation.evaluate import evaluate

    model, tokenizer = shipped
    report = json.loads((ASSET / "build_report.json").read_text())
    examples = load_dataset_source(report["held_out"]["data"], limit=100)
    torch.set_num_threads(2)
    result = evaluate(model, tokenizer, examples, batch_size=100, max_new_tokens=64, progress=False)
    assert result["format_rate"] > MIN_FORMAT_RATE
    assert abs(result["accuracy"] - report["held_out"]["first_100_accuracy"]) <= 0.03


# The --quick build: 150 small SFT steps on a CPU (about 3 minutes). That is far too short for the
# arithmetic (measured: greedy 0% on the 100 held-out problems, the full build needs 1800 steps of 4x
# the batch, a GPU job - see the test below), so what it checks is that the script still builds a
# working model: the chat format is learned (100% measured) and the SFT loss fell well below its start
# (6.34 -> 1.03 measured; a broken target or masking would leave it near the start).
QUICK_MIN_FORMAT_RATE = 0.80
QUICK_MAX_LOSS_RATIO = 0.35


def test_quick_build_still_produces_a_working_model(tmp_path):
    out = tmp_path / "tiny-math"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)], check=True,
                   cwd=REPO_ROOT, timeout=1800)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen2" and tokenizer.chat_template
    report = json.loads((out / "build_report.json").read_text())
    held_out = report["held_out"]
    assert held_out["n"] == 100 and report["training"]["steps"] == 150
    assert held_out["format_rate"] >= QUICK_MIN_FORMAT_RATE, held_out
    history = report["training"]["history"]
    assert history[-1]["problem_loss"] < QUICK_MAX_LOSS_RATIO * history[0]["problem_loss"], history
    assert history[-1]["bare_loss"] < QUICK_MAX_LOSS_RATIO * history[0]["bare_loss"], history


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the full build is a GPU job (4.5 min on an H200)")
def test_full_build_on_a_gpu_lands_in_the_shipped_bands(tmp_path):
    # The shipped recipe from scratch: the greedy/format/pass@8 bands of the issue, and the planted
    # headroom (greedy stops after one step on most multi-step problems while sampling completes them).
    out = tmp_path / "tiny-math"
    subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(out)], check=True,
                   cwd=REPO_ROOT, timeout=1800)
    held_out = json.loads((out / "build_report.json").read_text())["held_out"]
    assert held_out["n"] == 500
    assert GREEDY_ACCURACY_BAND[0] <= held_out["accuracy"] <= GREEDY_ACCURACY_BAND[1], held_out
    assert held_out["format_rate"] > MIN_FORMAT_RATE and held_out["pass@8"] >= MIN_PASS_AT_8, held_out
    assert held_out["by_steps"]["2-step"]["greedy_stops_after_one_step"] > 0.5
