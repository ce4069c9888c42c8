"""The README's promises that can be checked mechanically."""

from pathlib import Path

from grpo.config.docs import BEGIN, END, config_keys_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_config_table_is_generated_from_the_config_tree():
    text = README.read_text()
    section = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert section == config_keys_markdown(), "regenerate with: grpo keys --markdown (see grpo.config.docs)"


def test_readme_shows_the_two_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
