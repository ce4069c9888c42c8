"""A tool for the multi-turn kill test: the calculator (named as the tiny tool model calls it), with each call noted in a file (so the test knows a
tool call is in flight) and a short sleep (so a kill can land inside it)."""

import os
import time

from grpo.multiturn.calculator import calculator as _calculator


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: An arithmetic expression with numbers, + - * / and parentheses, e.g. "4821 * 37".
    """
    marker = os.environ.get("GRPO_TEST_TOOL_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(expression.replace("\n", " ") + "\n")
    time.sleep(0.3)
    return _calculator(expression)
