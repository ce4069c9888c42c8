"""A multi-turn completion recorded as its messages: in samples.jsonl (``sample_records``) and in TRL's
log_completions output (``grpo.api.completions``: the printed panel and the parquet file)."""

from __future__ import annotations

import dataclasses

import pytest

from grpo.api.completions import completion_table, log_completions
from grpo.step.metrics import sample_records
from step_helpers import random_batch

CONVERSATION = [
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]},
    {"role": "tool", "name": "calculator", "content": "408"},
    {"role": "assistant", "content": "", "tool_calls": [  # a malformed call, answered with its parse error
        {"type": "function", "function": {"name": None, "arguments": None}}]},
    {"role": "tool", "name": "unknown", "content": "the tool call is not valid JSON"},
    {"role": "assistant", "content": "<answer>408</answer>"},
]


def multi_turn_batch():
    batch = random_batch(vocab=50, N=4)
    generation = dataclasses.replace(batch.generation, messages=[CONVERSATION] * 4,
                                     completions=["12 * 34 408 <answer>408</answer>"] * 4)
    prompts = [[{"role": "user", "content": f"What is 12 * 34? ({i})"}] for i in range(4)]
    return dataclasses.replace(batch, generation=generation, chat_prompts=prompts, chat_completions=[CONVERSATION] * 4,
                               reward_extras={"parsed": ["408"] * 4})


def test_samples_jsonl_records_a_multi_turn_completion_as_its_messages():
    records = sample_records(multi_turn_batch(), 2)
    assert records[0]["completion"] == CONVERSATION  # the tool's result is readable: role "tool", content "408"
    assert records[0]["completion_text"].endswith("<answer>408</answer>")
    single = sample_records(random_batch(vocab=50, N=4), 1)[0]
    assert single["completion"] == "" and "completion_text" not in single  # single-turn: the text, as before


def test_log_completions_prints_trls_panel_and_writes_its_parquet(tmp_path, capsys, monkeypatch):
    pd = pytest.importorskip("pandas")
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps cells to the terminal's width
    batch = multi_turn_batch()
    table = completion_table(batch)
    path = log_completions(table, 3, tmp_path, num_to_print=2)
    assert path == tmp_path / "completions" / "completions_00003.parquet"
    frame = pd.read_parquet(path)
    assert list(frame.columns) == ["step", "prompt", "completion", "r", "parsed", "advantage"]
    assert len(frame) == 4 and (frame["step"] == 3).all()
    assert frame["advantage"].tolist() == pytest.approx(batch.advantages.tolist())
    roles = [m["role"] for m in frame["completion"][0]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert frame["completion"][0][1]["content"] == "408"
    printed = capsys.readouterr().out
    assert "Step 3" in printed and "TOOL" in printed and "calculator(expression='12 * 34')" in printed
    assert printed.count("What is 12 * 34?") == 2  # num_completions_to_print of the 4
