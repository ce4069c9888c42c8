"""The promises page (docs/guides/reliability.md, "What grpo promises") names tests that exist: a renamed or
deleted test breaks this one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "guides" / "reliability.md"


def test_every_promise_links_to_tests_that_exist():
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) >= 25
    for row in rows:
        cells = row.split(" | ")
        links = re.findall(r"\[[^\]]+\]\(([^)]+)\)((?:[^[|]*))", cells[-1])
        assert links, f"a promise without a test: {row}"
        for path, names in links:
            file = (PAGE.parent / path).resolve()  # links are relative to the page, as the site's hook reads them
            assert file.is_file(), f"{path} does not exist"
            defined = set(re.findall(r"^def (test_\w+)", file.read_text(), flags=re.MULTILINE))
            for name in re.findall(r"::(test_\w+\*?)", names):
                if name.endswith("*"):
                    assert any(d.startswith(name[:-1]) for d in defined), f"no {name} in {path}"
                else:
                    assert name in defined, f"no {name} in {path}"
