"""A calculator tool (``rollout.tools: [grpo.multiturn.calculator:calculator]``): arithmetic on an expression.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs and parentheses are
evaluated; anything else (names, calls, attributes, strings) is refused, so a model cannot run code through it.
Every refusal raises ``ValueError`` (``ZeroDivisionError`` for a zero divisor, ``TypeError`` for a non-string) with a message meant for the
model: grpo answers a raising tool with ``{"error": message}`` in the tool turn.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # |b| in a ** b: 10**100 is still quick; 10**10**9 would hang the worker thread
MAX_DIGITS = 200  # digits of any intermediate integer (2**600 has 181): bounds time and the reply's length

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "4821 * 37".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(text)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    return format_number(_evaluate(tree.body))


def format_number(value: float) -> str:
    """An int as it is; a float that is a whole number as an int ("8 / 2" gives "4", so an answer can copy it);
    other floats with up to 12 significant digits ("0.333333333333")."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"the result is not a finite number ({value})")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed, got {node.value!r}")  # noqa: TRY004  (bad input text)
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT} in absolute value)")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError(f"division by zero in {left} {_SYMBOL[type(node.op)]} {right}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError(f"{left} {_SYMBOL[type(node.op)]} {right} is too large") from None
        if isinstance(result, complex):  # (-8) ** 0.5
            raise ValueError(f"{left} {_SYMBOL[type(node.op)]} {right} is not a real number")
        return _checked(result)
    raise ValueError(f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def _checked(value: float) -> int | float:
    # bits, not str(): Python refuses to print ints of more than 4300 digits
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * math.log2(10):
        raise ValueError(f"a number has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the result is not a finite number ({value})")
    return value
