"""The documentation site built once per session (``mkdocs build --strict``, as `make docs` builds it), for the
build test and the browser test. Skips, saying what to install, where the `docs` extra is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def mkdocs_build(site_dir: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of this checkout into ``site_dir`` (grpo's own source first on the path, for
    mkdocstrings, whichever grpo is installed)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
               "--site-dir", str(site_dir)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[docs]' (the `docs` extra)")
    site = tmp_path_factory.mktemp("build") / "site"
    proc = mkdocs_build(site)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return site
