"""The source keeps short bodies and distinct names: no function in src/grpo over 80 lines (a long body is split
into named steps, as ``train_on_batch`` reads like GRPO-Zero's ``update_policy``), no two modules named alike."""

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


def test_no_two_modules_share_a_file_name():
    """A file name says what the module is: two modules named alike (setup.py, builtin.py) would be two things
    under one name. Packages' ``__init__.py`` aside."""
    names: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(path.relative_to(SRC).as_posix())
    repeated = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not repeated, f"modules that share a file name: {repeated}"
