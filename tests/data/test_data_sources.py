"""Data source strings (config `data.train` / `data.eval`): synthetic specs, prompt files, GSM8K paths, hub ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo.data import DataError, generate_problems, load_dataset_source


def test_synthetic_spec_matches_the_generator() -> None:
    examples = load_dataset_source("synthetic:seed=123,n=12,difficulty=medium")
    assert examples == generate_problems(12, seed=123, difficulty="medium")
    assert len(load_dataset_source("synthetic:seed=1,n=50", limit=7)) == 7
    assert load_dataset_source("synthetic: seed = 4 , n = 3 , steps = 4 , max_digits = 1") == generate_problems(
        3, 4, steps=4, max_digits=1
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "synthetic:seed=1,n=5,size=3",
            "unknown key 'size'; allowed keys: ['difficulty', 'max_digits', 'n', 'seed', 'steps']",
        ),
        ("synthetic:n=5", "missing key(s) ['seed']; allowed keys:"),
        ("synthetic:seed=1,n=five", "n must be an integer, got 'five'"),
        ("synthetic:seed=1,n=5,", "expected key=value, got ''"),
        ("synthetic:seed=1,seed=2,n=5", "key 'seed' given twice"),
        ("synthetic:", "expected key=value"),
        ("prompts:question_column=src", "missing key(s) ['path']"),
    ],
)
def test_bad_specs_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(DataError, match=re.escape(f"data source {spec!r}: {message}")):
        load_dataset_source(spec)


def test_synthetic_value_errors_come_from_the_generator() -> None:
    with pytest.raises(ValueError, match="unknown difficulty 'brutal'"):
        load_dataset_source("synthetic:seed=1,n=5,difficulty=brutal")


def test_paths_and_folders_load_gsm8k(tmp_path: Path) -> None:
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 3"}) + "\n", encoding="utf-8")
    assert [e.answer for e in load_dataset_source(str(tmp_path), split="test")] == ["3"]
    assert [e.answer for e in load_dataset_source(str(tmp_path / "test.jsonl"))] == ["3"]


def test_prompts_spec_reads_any_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"src": ["Hi", "2 + 2?"], "tgt": ["Hello"], "gold": "4"}) + "\n", encoding="utf-8")
    (example,) = load_dataset_source(f"prompts:path={path},question_column=src,answer_column=gold")
    assert [m["role"] for m in example.messages] == ["user", "assistant", "user"]
    assert example.answer == "4"


def test_real_gsm8k_folder_as_a_source(gsm8k_dir: Path) -> None:
    assert len(load_dataset_source(str(gsm8k_dir), split="test")) == 1319


def test_missing_path_is_file_not_found() -> None:
    with pytest.raises(DataError, match="does/not/exist.jsonl: file not found"):
        load_dataset_source("does/not/exist.jsonl")
    with pytest.raises(DataError, match="non-empty string"):
        load_dataset_source("  ")


def test_hub_id_offline_says_to_pass_a_local_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub is never contacted: `datasets.load_dataset` is replaced by one that fails as offline."""
    import datasets

    calls = []

    def offline(path: str, name: str | None = None, split: str | None = None) -> None:
        calls.append((path, name, split))
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="Without network access, download the dataset and pass a local file or folder"):
        load_dataset_source("openai/gsm8k", split="test")
    assert calls == [("openai/gsm8k", "main", "test")]
