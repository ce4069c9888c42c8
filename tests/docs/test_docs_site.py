"""The site builds with ``mkdocs build --strict`` (no broken link, anchor or reference; `make docs` builds it the
same way), and renders in a real browser: headless Chromium, from the OS packages, opens the home page and the
API reference and finds their title, the search box and a known symbol, and saves a screenshot for review."""

from __future__ import annotations

import functools
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict_with_every_page(built_site):
    for page in ("index.html", "getting-started/demo/index.html", "guides/python-api/index.html",
                 "reference/api/index.html", "reference/config/index.html", "reference/cli/index.html",
                 "reference/exit-codes/index.html", "development/layout/index.html", "benchmarks/index.html"):
        assert (built_site / page).is_file(), page
    assert not (built_site / "_incoming").exists()  # text handed over for later is never published
    api = (built_site / "reference" / "api" / "index.html").read_text()
    for symbol in ("grpo.api.GRPOTrainer", "grpo.api.GRPOConfig", "grpo.config.load_config", "grpo.tasks.Task"):
        assert f'id="{symbol}"' in api, symbol  # rendered from the docstrings by mkdocstrings


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no headless Chromium: install the OS package (apt-get install chromium); `make test` does as root")


def _chromium_run(*args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start. The virtual time budget lets the
    # theme's scripts run before the DOM is dumped or the screenshot taken.
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=5000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the base class names it `format`
        pass


@pytest.fixture(scope="module")
def site_url(built_site):
    """The built site served over HTTP on a free local port, as a reader gets it (over file:// the theme's
    search runs no worker and hides its box)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built_site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("page, title, symbol", [
    ("index.html", "grpo", "GRPOTrainer"),
    ("reference/api/index.html", "Python API - grpo", "grpo.api.GRPOTrainer"),
])
def test_chromium_renders_the_page_with_its_title_search_and_symbol(site_url, page, title, symbol):
    proc = _chromium_run("--dump-dom", site_url + page)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dom = proc.stdout
    assert f"<title>{title}</title>" in dom
    assert 'data-md-component="search-query"' in dom  # Material's search box, in the rendered page
    assert symbol in dom


def test_chromium_saves_a_screenshot_of_the_api_reference(built_site, site_url):
    shot = built_site.parent / "screenshots" / "reference-api.png"  # beside the site, in the build folder
    shot.parent.mkdir(exist_ok=True)
    proc = _chromium_run("--window-size=1280,900", f"--screenshot={shot}", site_url + "reference/api/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank image
