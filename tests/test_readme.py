"""The README is the front page: short, the two set-up commands, and links that lead somewhere. What it used to
hold is on the documentation site (docs/), whose promises tests/docs checks."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def test_readme_is_a_front_page_of_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_shows_exactly_the_two_setup_commands():
    text = README.read_text()
    block = text[text.index("## Two commands"):]
    block = block[block.index("```bash\n") + len("```bash\n"):]
    commands = [line.split("#")[0].strip() for line in block[:block.index("```")].splitlines()]
    assert commands == ["make demo", "make test"]


def test_every_link_of_the_readme_leads_to_a_file_and_its_heading():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 20
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:  # MkDocs' heading ids: lower case, punctuation dropped, spaces as hyphens
            ids = {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", line.lstrip("#").strip().lower()))
                   for line in target.read_text().splitlines() if line.startswith("#")}
            assert anchor in ids, f"README links to {link}: no such heading in {path}"
