"""Fixtures of the reliability suite (its own helpers are in ``reliability_helpers``, those it shares with the
integration suite in tests/integration/run_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# pytest puts only this folder on sys.path for this suite's modules: run_helpers is found in tests/integration.
INTEGRATION_DIR = str(Path(__file__).resolve().parents[1] / "integration")
if INTEGRATION_DIR not in sys.path:
    sys.path.insert(0, INTEGRATION_DIR)

from reliability_helpers import RECIPE  # noqa: E402
from run_helpers import rewards_on_path  # noqa: E402


@pytest.fixture(scope="session")
def recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(autouse=True)
def _test_rewards_importable():
    with rewards_on_path():
        yield


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """In-process runs use one thread, as the subprocesses do (``cli_env``): every run then adds floats
    in the same order (in-process and subprocess runs are compared), and two cores shared with other
    work are not oversubscribed (tiny models gain nothing from threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
