"""The calculator demo's data source (``arithmetic-tools:``): deterministic, sizes as promised, the worked
solution's arithmetic right, the expression a calculator would be asked computed to the gold answer."""

from __future__ import annotations

import re

import pytest

from grpo.data import DataError, load_dataset_source
from grpo.data.arithmetic_tools import SIZES, generate_tool_problems, is_large
from grpo.multiturn.calculator import calculator
from grpo.rewards import get_reward_function

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_spec_matches_the_generator_and_is_deterministic() -> None:
    examples = load_dataset_source("arithmetic-tools:seed=123,n=40,size=large")
    assert examples == generate_tool_problems(40, seed=123, size="large")
    assert examples != generate_tool_problems(40, seed=124, size="large")
    assert load_dataset_source("arithmetic-tools:seed=5,n=30") == generate_tool_problems(30, 5, "mix")
    assert generate_tool_problems(50, seed=9)[:7] == generate_tool_problems(7, seed=9)  # a prefix keeps
    assert len(load_dataset_source("arithmetic-tools:seed=1,n=50", limit=6)) == 6
    assert examples[0].source == "arithmetic-tools(seed=123,size=large):1"


@pytest.mark.parametrize("size", SIZES)
def test_problems_are_one_right_step_of_the_size(size: str) -> None:
    examples = generate_tool_problems(400, seed=11, size=size)
    large = [is_large(e) for e in examples]
    for example in examples:
        (left, op, right, result), = EQUATION.findall(example.solution)
        assert example.answer == example.answer_raw == result and int(result) >= 0
        assert calculator(f"{left} {op} {right}") == result  # the call the model should make gives the answer
        assert left in example.question and right in example.question
        if is_large(example):
            assert max(len(left), len(right), len(result)) >= 4
        else:
            assert int(left) < 1200 and int(right) < 100
    if size == "mix":
        assert 0.4 < sum(large) / len(large) < 0.6
    else:
        assert all(large) if size == "large" else not any(large)
    ops = {EQUATION.search(e.solution).group(2) for e in examples}
    assert ops == {"+", "-", "*", "/"}


def test_bad_specs_and_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown size 'huge'; known: \['large', 'small', 'mix'\]"):
        load_dataset_source("arithmetic-tools:seed=1,n=5,size=huge")
    with pytest.raises(DataError, match=r"unknown key 'difficulty'; allowed keys: \['n', 'seed', 'size'\]"):
        load_dataset_source("arithmetic-tools:seed=1,n=5,difficulty=demo")
    with pytest.raises(DataError, match=r"missing key\(s\) \['seed'\]"):
        load_dataset_source("arithmetic-tools:n=5")
    with pytest.raises(ValueError, match="n must be a positive integer"):
        generate_tool_problems(0, seed=1)


def test_answer_correct_scores_a_tool_using_completion_by_its_final_answer() -> None:
    # The recipe's reward reads a multi-turn completion (assistant call, tool result, assistant answer) as the
    # concatenated contents: the tool result's number is not an <answer>, the last <answer> decides.
    example = generate_tool_problems(1, seed=3, size="large")[0]
    (left, op, right, result), = EQUATION.findall(example.solution)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{left} {op} {right}"}}}]}
    tool = {"role": "tool", "name": "calculator", "content": result}

    def answering(number: str) -> dict:
        return {"role": "assistant", "content": f"<think>\n{left} {op} {right} = {number}\n</think>\n"
                                                f"<answer>\n{number}\n</answer>"}

    reward = get_reward_function("answer_correct", tag_style="think")
    completions = [[call, tool, answering(result)], [call, tool, answering("1")], [call, tool]]
    assert reward([None] * 3, completions, answer=[example.answer] * 3) == [1.0, -1.0, -1.0]
