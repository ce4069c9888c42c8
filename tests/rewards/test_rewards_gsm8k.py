"""Every GSM8K test answer, written in the expected format, is rewarded as correct and well formatted."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import pytest

from grpo.rewards import get_reward_function

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def load_golds() -> list[str]:
    if not GSM8K_TEST.parent.is_dir():
        pytest.skip(f"GSM8K data folder {GSM8K_TEST.parent} is absent (it lives beside the repository)")
    lines = GSM8K_TEST.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["answer"].split("####")[-1].strip() for line in lines if line.strip()]


def completion(answer: str) -> str:
    return f"<think>\nsome reasoning\n</think>\n<answer>\n{answer}\n</answer>"


def test_all_gsm8k_test_answers_score_correct_and_off_by_one_scores_wrong():
    golds = load_golds()
    assert len(golds) == 1319  # the GSM8K test split
    prompts = ["question"] * len(golds)
    answer_correct = get_reward_function("answer_correct", tag_style="think")
    format_think_answer = get_reward_function("format_think_answer", tag_style="think")

    start = time.perf_counter()
    right = answer_correct(prompts, [completion(g) for g in golds], answer=golds)
    formats = format_think_answer(prompts, [completion(g) for g in golds])
    # gold + 1, computed on the number without thousands separators
    off_by_one = [str(Decimal(g.replace(",", "")) + 1) for g in golds]
    wrong = answer_correct(prompts, [completion(a) for a in off_by_one], answer=golds)
    elapsed = time.perf_counter() - start

    assert [g for g, r in zip(golds, right) if r != 1.0] == []
    assert [g for g, f in zip(golds, formats) if f != 1.25] == []
    assert [(g, a) for g, a, r in zip(golds, off_by_one, wrong) if r != -1.0] == []
    # Plain numbers never reach math-verify, so three passes over the split stay fast.
    assert elapsed < 5.0, f"scoring GSM8K took {elapsed:.1f} s"
