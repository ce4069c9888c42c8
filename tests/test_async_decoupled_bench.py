"""benchmarks/async_decoupled.py --dry-run: its four runs' commands load as valid configs (a bad override would
otherwise surface an hour into the full benchmark), with the settings each variant compares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess that imports grpo
def test_the_dry_run_prints_four_valid_runs_and_the_eval():
    script = REPO / "benchmarks" / "async_decoupled.py"
    proc = subprocess.run([sys.executable, str(script), "--dry-run", "--seeds", "2"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    commands = [line.split() for line in proc.stdout.splitlines() if " -m grpo train " in line]
    assert len(commands) == 4 and " -m grpo eval " in proc.stdout
    configs = []
    for cmd in commands:
        recipe, overrides = cmd[cmd.index("train") + 1], cmd[cmd.index("train") + 2:]
        configs.append(load_config(recipe, overrides))
    per_chunk, control, in_flight, partial = configs
    assert all(c.train.mode == "decoupled" and c.decoupled.trainer_ranks == 1 and c.decoupled.num_samplers == 2
               and c.train.seed == 2 for c in configs)
    assert (per_chunk.decoupled.weight_update, per_chunk.train.max_staleness) == ("per_chunk", 1)
    # the control: per chunk at (c)'s looser staleness bound, without partial rollouts
    assert (control.decoupled.weight_update, control.train.max_staleness) == ("per_chunk", partial.train.max_staleness)
    assert partial.train.max_staleness > 1 and not control.decoupled.partial_rollouts
    assert (in_flight.decoupled.weight_update, in_flight.train.max_staleness) == ("in_flight", 1)
    assert partial.decoupled.weight_update == "in_flight" and partial.decoupled.partial_rollouts
    assert not per_chunk.decoupled.partial_rollouts and not in_flight.decoupled.partial_rollouts
