"""Every Python and shell snippet of the README and the documentation pages is run by a test or marked as
illustrative, by an HTML comment on the line before its fence (invisible on the site and on a forge):

    <!-- snippet: run -->                                  run here, as it is written (tiny models, a CPU)
    <!-- snippet: tested by tests/x.py::test_name -->      that test reads this page and runs the snippet
    <!-- snippet: illustrative (why it is not run) -->     an outline, a GPU, a long run: the reason is required

A snippet without one fails `test_every_snippet_is_run_or_marked_illustrative`."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LANGUAGES = {"python", "py", "pycon", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!-- snippet: (run|tested by (\S+)::(test_\w+)|illustrative \(.+\)) -->$")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # the line before the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if "_incoming" not in p.relative_to(REPO).parts]
    return [REPO / "README.md", *docs]


def snippets(page: Path) -> list[Snippet]:
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if opening.group(1) in LANGUAGES:
            marker = lines[i - 1] if i and lines[i - 1].startswith("<!-- snippet") else None
            found.append(Snippet(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n", marker))
        i = end + 1
    return found


ALL = [s for page in pages() for s in snippets(page)]
RUN = [s for s in ALL if s.marker == "<!-- snippet: run -->"]


def test_every_snippet_is_run_or_marked_illustrative():
    assert len(ALL) >= 15
    unmarked = [s.where for s in ALL if s.marker is None or not MARKER.match(s.marker)]
    assert not unmarked, ("snippets with no marker (or a malformed one) on the line before the fence; see this "
                          f"file's docstring: {unmarked}")
    assert RUN, "no snippet is run"


def test_the_tests_named_by_snippets_exist_and_read_their_page():
    for snippet in ALL:
        match = MARKER.match(snippet.marker or "")
        if not match or not match.group(2):
            continue
        test_file = REPO / match.group(2)
        assert test_file.is_file(), f"{snippet.where}: {match.group(2)} does not exist"
        source = test_file.read_text()
        name = match.group(3)
        assert re.search(rf"^def {name}\(", source, flags=re.MULTILINE), f"{snippet.where}: no {name}"
        parts = snippet.page.relative_to(REPO).parts  # the test names the page (as a path or as its parts)
        assert "/".join(parts) in source or all(f'"{part}"' in source for part in parts), \
            f"{snippet.where}: {match.group(2)} does not read {snippet.page.name}"


def _workdir(tmp_path: Path) -> dict[str, str]:
    """A scratch folder that sees the repository's models, recipes and examples, and an environment whose
    `grpo` is this checkout's (``python -m grpo``), so that a snippet runs as written without writing here."""
    for name in ("assets", "configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "grpo"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m grpo "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="2",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
def test_the_snippet_runs_as_written(snippet, tmp_path):
    env = _workdir(tmp_path)
    if snippet.language in ("python", "py"):
        command = [sys.executable, "-c", snippet.code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", snippet.code]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{snippet.where} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.stdout.strip(), f"{snippet.where} printed nothing"
