"""The calculator demo's model (assets/tiny-tools) and the script that builds it (issue 27).

(a) The shipped model loads with plain ``from_pretrained``; its tool tokens are single tokens that survive
    decoding as the driver decodes; its build report shows the headroom the recipe relies on (bad alone on
    large numbers, right when it calls the calculator, calling only sometimes) and names the recipe's eval set.
(b) ``scripts/build_tiny_tool_model.py --quick`` still builds a model that loads, renders tool conversations
    and whose SFT loss fell (so the script cannot rot).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSET = REPO_ROOT / "assets" / "tiny-tools"
SCRIPT = REPO_ROOT / "scripts" / "build_tiny_tool_model.py"
RECIPE = REPO_ROOT / "configs" / "tools-demo-cpu.yaml"


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(ASSET), AutoTokenizer.from_pretrained(ASSET)


def test_shipped_model_is_a_small_qwen2_with_single_tool_tokens(shipped):
    model, tokenizer = shipped
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 30 * 2**20
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    for token in ("<tool_call>", "</tool_call>", '"calculator"', '"expression"'):
        assert tokenizer.convert_tokens_to_ids(token) in ids
    assert len(ids) <= 32  # 30 measured; ~60 with the JSON spelt one character per token
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == call
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_shipped_build_report_shows_the_planted_headroom():
    report = json.loads((ASSET / "build_report.json").read_text())
    recipe = yaml.safe_load(RECIPE.read_text())
    large, small = report["held_out"]["large"], report["held_out"]["small"]
    assert large["data"] == recipe["data"]["eval"]
    assert recipe["rollout"]["tools"] == ["grpo.multiturn.calculator:calculator"]
    sampled = large["T=1"]
    # Sometimes calls, and a call is mostly right; alone it is mostly wrong on large numbers.
    assert 0.1 <= sampled["tool_call_rate"] <= 0.5, sampled
    assert sampled["accuracy_with_call"] >= 0.6 and sampled["accuracy_without_call"] <= 0.3, sampled
    assert large["greedy"]["accuracy"] <= 0.5 and small["greedy"]["accuracy"] >= 0.7, report["held_out"]
    assert report["wall_seconds"] < 45 * 60


# --quick: 20 SFT steps of 16 problems (~1 minute on 2 cores). Too short to teach the call, so it checks the
# plumbing: the model saves and loads with its template and tool tokens, and the loss fell from its start.
def test_quick_build_still_produces_a_working_model(tmp_path):
    out = tmp_path / "tiny-tools"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], check=True, cwd=REPO_ROOT,
                   timeout=900)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.multiturn.calculator import calculator
    from grpo.multiturn.conversation import check_tool_template, tool_suffix_ids
    from grpo.multiturn.tools import tool_schema

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer)
    check_tool_template(tokenizer, [tool_schema(calculator)])
    assert tokenizer.decode(tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "7"}],
                                            [tokenizer.eos_token_id])) == \
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    report = json.loads((out / "build_report.json").read_text())
    history = report["training"]["history"]
    assert report["training"]["steps"] == 20 and report["held_out"]["large"]["greedy"]["n"] == 24
    assert history[-1]["loss"] < 0.5 * history[0]["loss"], history
