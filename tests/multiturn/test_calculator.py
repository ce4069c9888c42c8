"""The calculator tool: arithmetic evaluated through ``ast`` only, every refusal a ValueError (or
ZeroDivisionError) with a message for the model, a schema transformers can read, and its use through grpo's
Toolbox (a raising call becomes an error tool message, not a crash)."""

from __future__ import annotations

import json
import re

import pytest

from grpo.multiturn.calculator import (
    MAX_DIGITS,
    MAX_EXPONENT,
    MAX_EXPRESSION_CHARS,
    calculator,
)
from grpo.multiturn.tools import Toolbox, load_callable, tool_schema


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("4821 * 37", "178377"),
        ("  12 + 7 ", "19"),
        ("(2 + 3) * 4", "20"),
        ("2 + 3 * 4", "14"),  # precedence is Python's
        ("8 / 2", "4"),  # a whole-number quotient reads as an int, so an answer can copy it
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333333333"),  # 12 significant digits
        ("-7 // 2", "-4"),  # floor division, as Python
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("-(3 - 10)", "7"),
        ("+5", "5"),
        ("1.5 * 4", "6"),
        ("2 ** -1", "0.5"),
        ("123456789 * 987654321", "121932631112635269"),  # ints stay exact
    ],
)
def test_arithmetic(expression: str, result: str) -> None:
    assert calculator(expression) == result


@pytest.mark.parametrize(
    ("expression", "error", "message"),
    [
        ("", ValueError, "empty expression"),
        ("1 +", ValueError, "not an arithmetic expression: '1 +'"),
        ("abs(-3)", ValueError, "unsupported element Call"),
        ("__import__('os').system('true')", ValueError, "unsupported element Call"),
        ("x + 1", ValueError, "unsupported element Name"),
        ("(1).real", ValueError, "unsupported element Attribute"),
        ("'a' * 3", ValueError, "only numbers are allowed, got 'a'"),
        ("True + 1", ValueError, "only numbers are allowed, got True"),
        ("[1, 2]", ValueError, "unsupported element List"),
        ("1 < 2", ValueError, "unsupported element Compare"),
        ("1 / 0", ZeroDivisionError, "division by zero in 1 / 0"),
        ("5 % 0", ZeroDivisionError, "division by zero in 5 % 0"),
        (f"2 ** {MAX_EXPONENT + 1}", ValueError, f"exponent {MAX_EXPONENT + 1} is too large"),
        ("9 ** 9 ** 9", ValueError, "exponent 387420489 is too large"),  # would take minutes
        ("(-8) ** 0.5", ValueError, "is not a real number"),
        ("1e308 * 10", ValueError, "not a finite number"),
        ("10.0 ** 100 ** 1 * 1e300", ValueError, "not a finite number"),
        ("10 ** 99 * 10 ** 99 * 10 ** 99", ValueError, f"more than {MAX_DIGITS} digits"),
        ("(10 ** 100) ** 3", ValueError, f"more than {MAX_DIGITS} digits"),
        ("1+" * MAX_EXPRESSION_CHARS + "1", ValueError, f"more than {MAX_EXPRESSION_CHARS}"),
    ],
)
def test_refusals_are_errors_with_a_message(expression: str, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        calculator(expression)


def test_a_non_string_argument_is_refused() -> None:
    with pytest.raises(TypeError, match="expression must be a string, got int"):
        calculator(12)  # type: ignore[arg-type]


def test_schema_is_read_from_the_docstring() -> None:
    schema = tool_schema(calculator)
    function = schema["function"]
    assert function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert "4821 * 37" in function["parameters"]["properties"]["expression"]["description"]


def test_through_grpo_toolbox_results_and_errors_are_tool_messages() -> None:
    tool = load_callable("grpo.multiturn.calculator:calculator", "rollout.tools[0]")
    box = Toolbox([tool], timeout_s=5.0)
    ok = box.call("calculator", {"expression": "4821 * 37"})
    assert (ok.text, ok.failed) == ("178377", False)
    bad = box.call("calculator", {"expression": "1 / 0"})
    assert bad.failed and json.loads(bad.text) == {"error": "division by zero in 1 / 0"}
    wrong_argument = box.call("calculator", {"expr": "1 + 1"})
    assert wrong_argument.failed and "expr" in json.loads(wrong_argument.text)["error"]
