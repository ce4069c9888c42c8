"""Generic prompt files: text or chat-message questions, PaddleNLP src/tgt histories, answer formats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo.data import DataError, Example, load_prompts


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def roles(example: Example) -> list[str]:
    return [message["role"] for message in example.messages]


def test_plain_questions_without_answers(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": "Hi?"}, {"question": "Why?", "answer": "ignored"}])
    examples = load_prompts(path)
    assert [e.question for e in examples] == ["Hi?", "Why?"]
    assert all(e.answer is None and e.answer_raw is None for e in examples)
    assert examples[0].columns() == {
        "question": "Hi?", "answer": None, "answer_raw": None, "solution": None, "source": f"{path}:1",
    }


def test_custom_columns_and_plain_answers(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "Count?", "gold": "1,234"}, {"prompt": "N?", "gold": 7}])
    examples = load_prompts(path, question_column="prompt", answer_column="gold")
    assert [(e.answer, e.answer_raw) for e in examples] == [("1234", "1,234"), ("7", "7")]


def test_plain_text_answers_keep_their_commas(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": "Where?", "answer": " Paris, France "}])
    assert load_prompts(path, answer_column="answer")[0].answer == "Paris, France"


def test_gsm8k_answer_format(tmp_path: Path) -> None:
    rows = [{"question": "Q?", "answer": "1 + 1 = 2\n#### 2"}, {"question": "Q?", "answer": "2"}]
    path = write_rows(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(f"{path}:2: GSM8K answer has no '####'")):
        load_prompts(path, answer_column="answer", answer_format="gsm8k")
    first = load_prompts(path, answer_column="answer", answer_format="gsm8k", limit=1)
    assert [(e.answer, e.solution) for e in first] == [("2", "1 + 1 = 2")]


def test_unknown_answer_format_lists_known(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": "Q?"}])
    with pytest.raises(ValueError, match=r"unknown answer format 'latex'; known: \['gsm8k', 'plain'\]"):
        load_prompts(path, answer_column="answer", answer_format="latex")


def test_missing_answer_column_names_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": "Q?", "answer": "1"}, {"question": "Q?"}])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: missing key 'answer'")):
        load_prompts(path, answer_column="answer")


def test_question_as_chat_messages(tmp_path: Path) -> None:
    history = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?", "name": "dropped"},
    ]
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": history, "answer": "12"}])
    (example,) = load_prompts(path, question_column="messages", answer_column="answer")
    assert roles(example) == ["user", "assistant", "user"]
    assert example.question == "And times 3?" and example.answer == "12"
    assert example.messages[-1] == {"role": "user", "content": "And times 3?"}  # extra keys dropped


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "must end with a user turn"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}], "role 'system'"),
        ([{"role": "user"}], "keys 'role' and 'content'"),
        ([{"role": "user", "content": 3}], "content must be a string"),
    ],
)
def test_bad_chat_messages_name_the_line(tmp_path: Path, history: list, message: str) -> None:
    rows = [{"messages": [{"role": "user", "content": "fine"}]}, {"messages": history}]
    path = write_rows(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(f"{path}:2: column 'messages': ") + ".*" + re.escape(message)):
        load_prompts(path, question_column="messages")


def test_question_of_the_wrong_type(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": 42}])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: column 'question' must be a string")):
        load_prompts(path)


def test_src_tgt_multi_turn(tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "paddle.jsonl",
        [
            {"src": ["Hi", "What is 3 * 4?", "Plus one?"], "tgt": ["Hello!", "12"]},
            {"src": "Just one turn", "tgt": []},
            {"src": ["Only src"]},
        ],
    )
    examples = load_prompts(path, question_column="src")
    assert examples[0].messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 3 * 4?"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "Plus one?"},
    ]
    assert [roles(e) for e in examples[1:]] == [["user"], ["user"]]
    assert examples[1].question == "Just one turn"


@pytest.mark.parametrize(
    ("row", "got"),
    [
        ({"src": ["a", "b"], "tgt": []}, "need 1 assistant turn(s) in 'tgt' (the replies between them), got 0"),
        ({"src": ["a", "b"], "tgt": ["x", "y"]}, "need 1 assistant turn(s) in 'tgt' (the replies between them), got 2"),
        ({"src": "a", "tgt": "reference reply"}, "need 0 assistant turn(s) in 'tgt' (the replies between them), got 1"),
    ],
)
def test_src_tgt_wrong_lengths(tmp_path: Path, row: dict, got: str) -> None:
    path = write_rows(tmp_path / "paddle.jsonl", [{"src": "fine"}, row])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: src/tgt lengths do not match") + ".*" + re.escape(got)):
        load_prompts(path, question_column="src")


def test_src_tgt_with_non_string_turns(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "paddle.jsonl", [{"src": ["a", "b"], "tgt": [5]}])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: 'tgt' must hold only strings")):
        load_prompts(path, question_column="src")


def test_parquet_with_chat_messages(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(3)]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "chat.parquet")
    examples = load_prompts(tmp_path / "chat.parquet", question_column="messages", answer_column="answer")
    assert [(e.question, e.answer) for e in examples] == [("q0", "0"), ("q1", "1"), ("q2", "2")]


def test_example_checks_its_own_history() -> None:
    with pytest.raises(DataError, match="here:1: chat history must end with a user turn"):
        Example(messages=[{"role": "assistant", "content": "x"}], answer=None, answer_raw=None, source="here:1")
    with pytest.raises(DataError, match="non-empty list"):
        Example(messages=[], answer=None, answer_raw=None, source="here:2")
