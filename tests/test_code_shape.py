"""The source keeps short bodies: no function in src/grpo over 80 lines (a long body is split into named steps,
as ``train_on_batch`` reads like GRPO-Zero's ``update_policy``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "grpo"
MAX_LINES = 80


def function_lengths() -> dict[str, int]:
    lengths = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path.relative_to(SRC).as_posix()}:{node.name}"
                lengths[name] = max(lengths.get(name, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_over_80_lines():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps): {long}"
