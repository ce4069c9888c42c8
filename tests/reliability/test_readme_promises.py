"""The README's "What grpo promises" names tests that exist: a renamed or deleted test breaks this one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]


def promises_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## What grpo promises")
    return text[start:text.index("\n## ", start + 1)]


def test_every_promise_links_to_tests_that_exist():
    section = promises_section()
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) >= 25
    for row in rows:
        cells = row.split(" | ")
        links = re.findall(r"\[[^\]]+\]\(([^)]+)\)((?:[^[|]*))", cells[-1])
        assert links, f"a promise without a test: {row}"
        for path, names in links:
            file = REPO / path
            assert file.is_file(), f"{path} does not exist"
            defined = set(re.findall(r"^def (test_\w+)", file.read_text(), flags=re.MULTILINE))
            for name in re.findall(r"::(test_\w+\*?)", names):
                if name.endswith("*"):
                    assert any(d.startswith(name[:-1]) for d in defined), f"no {name} in {path}"
                else:
                    assert name in defined, f"no {name} in {path}"
