"""MkDocs hook (mkdocs.yml `hooks:`): links from a page to the repository's own files.

The pages link to tests, recipes and scripts by their relative path (``../../tests/test_wire.py``), which works
when docs/ is read on a forge. The site holds only docs/, so MkDocs would report those links as missing: here
each one is checked against the repository (a missing file is a warning, which ``--strict`` turns into a failed
build) and shown as the file's repository path in code, or linked under ``repo_url`` when mkdocs.yml sets one."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~)")


def _rewrite(line: str, page_dir: Path, docs: Path, repo: Path, repo_url: str | None, page: str) -> str:
    def repl(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs):  # a page or asset of the site: MkDocs checks it
            return match.group(0)
        if not path.is_relative_to(repo) or not path.exists():
            log.warning("%s links to %s, which is not a file of the repository", page, target)
            return match.group(0)
        rel = path.relative_to(repo).as_posix()
        if repo_url:
            return f"[{label}]({repo_url.rstrip('/')}/blob/main/{rel})"
        return label if "`" in label else f"`{label}`"
    return LINK.sub(repl, line)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    page_dir = (docs / page.file.src_path).parent
    out, in_fence = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        if not in_fence:
            line = _rewrite(line, page_dir, docs, repo, config.get("repo_url"), page.file.src_path)
        out.append(line)
    return "\n".join(out)
