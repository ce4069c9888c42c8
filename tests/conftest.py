"""Shared fixtures: an in-process tiny tokenizer and Qwen2 model (no hub access), data paths."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# GRPO_GSM8K_DIR: where the files are when the checkout has no shared/ beside it (a git worktree elsewhere)
GSM8K_DIR = Path(os.environ.get("GRPO_GSM8K_DIR") or REPO_ROOT / ".." / "shared" / "data" / "gsm8k").resolve()


@pytest.fixture(autouse=True, scope="session")
def _sigint_is_delivered():
    """The Ctrl-C tests send real SIGINTs, in-process and to child runs. A shell that starts the suite as a
    background job without job control (``make test &`` in a script) leaves SIGINT ignored for it, and
    children inherit an ignored signal: every run would then look uninterruptible. Python's own handler,
    as in an interactive run (children get the default action back at exec)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE with single-digit tokens, Qwen chat template, eos <|im_end|>, pad <|endoftext|>."""
    from grpo.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The real GSM8K files (never copied into the repo); skip when the shared folder is absent."""
    if not (GSM8K_DIR / "test.jsonl").exists():
        pytest.skip(f"real GSM8K files not found at {GSM8K_DIR} (shared/data/gsm8k beside the project, "
                    "or set GRPO_GSM8K_DIR)")
    return GSM8K_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Qwen2 + tokenizer saved in HF format (loaded back with from_pretrained by the code under test)."""
    from grpo.models.tiny import build_qwen2

    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_qwen2(tiny_tokenizer, hidden_size=64, num_layers=2, seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
