"""The tiny-model build scripts' ``--set KEY=VALUE``: one parser (build_tiny_math_model.set_overrides) for all three."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(SCRIPTS))  # as when a script runs: its folder is sys.path[0]
    wait_policy = os.environ.get("OMP_WAIT_POLICY")  # the scripts set it on import, for their own process
    try:
        import build_tiny_kk_model
        import build_tiny_math_model
        import build_tiny_tool_model

        yield build_tiny_math_model, build_tiny_kk_model, build_tiny_tool_model
    finally:
        sys.path.remove(str(SCRIPTS))
        if wait_policy is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = wait_policy


def test_set_parses_values_by_the_fields_type(scripts):
    math_script, kk_script, tool_script = scripts
    kk, _ = kk_script.parse_args(["--set", "people=[2, 4]", "--set", "planted_fraction=0.7", "--steps", "5",
                                  "--device", "cpu"])
    assert kk.people == (2, 4) and kk.planted_fraction == 0.7 and kk.steps == 5  # a list becomes a tuple
    math, _ = math_script.parse_args(["--set", "planted_fraction=0.5", "--device", "cpu"])
    assert math.planted_fraction == 0.5
    assert tool_script.parse_args(["--set", "tool_fraction_large=0.4"])[0].tool_fraction_large == 0.4


def test_unknown_setting_is_a_usage_error_listing_the_known(scripts, capsys):
    _, kk_script, _ = scripts
    with pytest.raises(SystemExit) as exit_info:
        kk_script.parse_args(["--set", "nope=1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown setting 'nope'" in err and "'planted_fraction'" in err
