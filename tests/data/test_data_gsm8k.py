"""GSM8K loading: the real files, every failure path (with file and line), and other file layouts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo.data import DataError, Example, is_number, load_gsm8k, to_gsm8k_record, write_gsm8k_jsonl
from grpo.data.locations import looks_like_hub_id


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def record(question: str, answer: str) -> str:
    return json.dumps({"question": question, "answer": answer})


GOOD = record("What is 2 + 3?", "2 + 3 = 5\n#### 5")


# --- the real data --------------------------------------------------------------------------


def test_real_gsm8k_train_and_test_sizes_and_numeric_golds(gsm8k_dir: Path) -> None:
    train = load_gsm8k(gsm8k_dir, split="train")
    test = load_gsm8k(gsm8k_dir, split="test")
    assert (len(train), len(test)) == (7473, 1319)
    assert all(is_number(example.answer) for example in train + test)
    assert train[0].answer == "72" and train[0].source.endswith("train.jsonl:1")
    assert train[0].solution is not None and "####" not in train[0].solution
    # Commas are kept in the raw gold and removed in the normalised one (79 such golds in train).
    with_commas = [example for example in train if "," in example.answer_raw]
    assert len(with_commas) == 79
    assert all(example.answer == example.answer_raw.replace(",", "") for example in with_commas)


def test_real_gsm8k_single_file_and_limit(gsm8k_dir: Path) -> None:
    examples = load_gsm8k(gsm8k_dir / "test.jsonl", limit=5)
    assert len(examples) == 5
    assert [example.source.rsplit(":", 1)[1] for example in examples] == ["1", "2", "3", "4", "5"]


# --- failure paths: each names the file and the 1-based line ----------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, GOOD, '{"question": "broken", "answer": '])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: invalid JSON")):
        load_gsm8k(path)


def test_missing_key_names_line_and_key(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, json.dumps({"question": "no answer here"})])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: missing key 'answer'")):
        load_gsm8k(path)


def test_missing_marker_is_an_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [record("q?", "the answer is 5")])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: GSM8K answer has no '####'")):
        load_gsm8k(path)


def test_non_numeric_gold_is_an_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, GOOD, GOOD, record("q?", "so\n#### five")])
    with pytest.raises(DataError, match=re.escape(f"{path}:4: GSM8K gold answer after '####' is not a number: 'five'")):
        load_gsm8k(path)


def test_non_object_line_is_an_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, "[1, 2]"])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: expected a JSON object, got list")):
        load_gsm8k(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_names_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}: file is empty")):
        load_gsm8k(path)


def test_missing_local_file_says_not_found(tmp_path: Path) -> None:
    for source in (tmp_path / "nope.jsonl", "no/such/dir/train.jsonl", "./missing"):
        with pytest.raises(DataError, match="file not found"):
            load_gsm8k(source)


def test_hub_ids_are_told_apart_from_paths() -> None:
    assert looks_like_hub_id("openai/gsm8k") and looks_like_hub_id("hf:gsm8k")
    assert not looks_like_hub_id("data/train.jsonl")
    assert not looks_like_hub_id("/abs/path") and not looks_like_hub_id("a/b/c")


def test_folder_without_the_split_lists_its_files(tmp_path: Path) -> None:
    write_lines(tmp_path / "train.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"no file for split 'validation'.*\['train.jsonl'\]"):
        load_gsm8k(tmp_path, split="validation")


def test_unsupported_suffix_lists_supported(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.csv", ["question,answer"])
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'.*'\.jsonl'"):
        load_gsm8k(path)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_bad_limit_is_rejected(tmp_path: Path, limit: object) -> None:
    with pytest.raises(ValueError, match="limit must be"):
        load_gsm8k(write_lines(tmp_path / "a.jsonl", [GOOD]), limit=limit)  # type: ignore[arg-type]


# --- other layouts and formats ----------------------------------------------------------------


def test_folder_picks_the_split_and_skips_blank_lines(tmp_path: Path) -> None:
    write_lines(tmp_path / "train.jsonl", [GOOD, "", record("Big?", "#### 1,080")])
    write_lines(tmp_path / "test.jsonl", [record("Other?", "#### 7")])
    train = load_gsm8k(tmp_path)
    assert [(e.answer, e.answer_raw) for e in train] == [("5", "5"), ("1080", "1,080")]
    assert train[1].source == f"{tmp_path / 'train.jsonl'}:3"  # the blank line still counts
    assert train[1].solution is None  # nothing before "####"
    assert [e.answer for e in load_gsm8k(tmp_path, split="test")] == ["7"]


def test_parquet_round_trip(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(4)]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "train.parquet")
    examples = load_gsm8k(tmp_path)  # found in the folder by split name
    assert [e.answer for e in examples] == ["1", "2", "3", "4"]
    assert examples[2].source == f"{tmp_path / 'train.parquet'}:row 3"
    assert [to_gsm8k_record(e) for e in examples] == rows


def test_parquet_shards_in_hub_layout(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    for shard in range(2):
        rows = [{"question": f"q{shard}?", "answer": f"#### {shard}"}]
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / f"test-0000{shard}-of-00002.parquet")
    assert [e.answer for e in load_gsm8k(tmp_path, split="test")] == ["0", "1"]


def test_json_array_file_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(
        '[\n  {"question": "A?", "answer": "#### 1"},\n\n  {"question": "B?",\n   "answer": "#### 2"}\n]\n',
        encoding="utf-8",
    )
    examples = load_gsm8k(path)
    assert [(e.question, e.answer) for e in examples] == [("A?", "1"), ("B?", "2")]
    assert [e.source for e in examples] == [f"{path}:2", f"{path}:4"]


def test_json_array_errors_point_at_the_bad_element(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text('[\n  {"question": "A?", "answer": "#### 1"},\n  {"question": "B?"}\n]', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: missing key 'answer'")):
        load_gsm8k(path)
    path.write_text('[\n  {"question": "A?", "answer": "#### 1"},\n  {"question": }\n]', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: invalid JSON")):
        load_gsm8k(path)


def test_json_file_holding_json_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.json", [GOOD, record("B?", "#### 9")])
    assert [e.answer for e in load_gsm8k(path)] == ["5", "9"]


def test_write_and_reload_keeps_questions_answers_and_solutions(tmp_path: Path) -> None:
    original = load_gsm8k(write_lines(tmp_path / "a.jsonl", [GOOD, record("Big?", "x\ny\n#### 1,080")]))
    out = tmp_path / "b.jsonl"
    assert write_gsm8k_jsonl(original, out) == 2
    reloaded = load_gsm8k(out)
    assert [(e.question, e.answer, e.answer_raw, e.solution) for e in reloaded] == [
        (e.question, e.answer, e.answer_raw, e.solution) for e in original
    ]


def test_to_gsm8k_record_refuses_what_it_cannot_write() -> None:
    no_gold = Example(messages=[{"role": "user", "content": "q"}], answer=None, answer_raw=None, source="x:1")
    with pytest.raises(ValueError, match="without a gold answer"):
        to_gsm8k_record(no_gold)
    multi_turn = Example(
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        answer="1", answer_raw="1", source="x:2",
    )
    with pytest.raises(ValueError, match="3 messages"):
        to_gsm8k_record(multi_turn)
