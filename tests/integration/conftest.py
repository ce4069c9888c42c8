"""Fixtures of the integration suite (helpers are in ``run_helpers``)."""

from __future__ import annotations

import pytest
from run_helpers import rewards_on_path


@pytest.fixture(autouse=True)
def _test_rewards_importable():
    """In-process runs import the tests' dotted-path rewards (``rewards_for_tests:letters``, ...) as a user's
    would; subprocesses get them through ``run_helpers.cli_env``."""
    with rewards_on_path():
        yield
