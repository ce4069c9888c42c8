"""Fixtures of the reliability suite (helpers are in ``reliability_helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reliability_helpers import RECIPE, rewards_on_path


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
