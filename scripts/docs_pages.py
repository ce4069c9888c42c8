"""Regenerate the site's tables that come from the code: the config keys (docs/reference/config.md, from the
config tree), the command line (docs/reference/cli.md, from the argparse parsers) and the architecture matrix
(docs/guides/models.md, from the table tests/integration/test_architectures.py checks cell by cell:
tests/architectures.py). `make docs` runs it before `mkdocs build`; tests/docs/test_docs_pages.py checks that the
committed pages are current.

    python scripts/docs_pages.py            # rewrite the pages
    python scripts/docs_pages.py --check    # exit 1 naming each page that is out of date"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
MATRIX_BEGIN, MATRIX_END = "<!-- architecture-matrix:begin -->", "<!-- architecture-matrix:end -->"


def architecture_matrix(page: str) -> str:
    """``page`` with the architecture matrix between its markers: tests/architectures.py's ``matrix_markdown``, the
    families of the installed transformers."""
    name = "docs_pages_architectures"  # its own name: the tests' import of the module stays theirs
    spec = importlib.util.spec_from_file_location(name, DOCS.parent / "tests" / "architectures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    start, end = page.index(MATRIX_BEGIN) + len(MATRIX_BEGIN), page.index(MATRIX_END)
    return page[:start] + "\n" + module.matrix_markdown() + page[end:]


def generated_pages() -> dict[Path, str]:
    """Each generated page and the text it should have now."""
    from grpo.cli import build_parser
    from grpo.commands import cli_reference
    from grpo.config import docs as config_docs

    config_page, cli_page = DOCS / "reference" / "config.md", DOCS / "reference" / "cli.md"
    models_page = DOCS / "guides" / "models.md"
    return {config_page: config_docs.replace_section(config_page.read_text()),
            cli_page: cli_reference.replace_section(cli_page.read_text(), build_parser()),
            models_page: architecture_matrix(models_page.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report pages that are out of date")
    args = parser.parse_args()
    stale = [path for path, text in generated_pages().items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(DOCS.parent)} is out of date: run python scripts/docs_pages.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated_pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
