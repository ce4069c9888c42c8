"""Helpers of the reliability suite: its tiny run recipe, overrides of it, run-folder snapshots (the helpers it
shares with the integration suite, such as the CLI environment and the metrics readers, are in
tests/integration/run_helpers.py).

Every test of the suite drives the real command line (``grpo.cli.main`` in-process, or ``python -m grpo`` in
a subprocess when a process must really be killed) on the session's tiny Qwen2 (``tiny_model_dir``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from run_helpers import as_overrides  # tests/integration: on sys.path through this suite's conftest.py

# The smallest run that still exercises everything: 2 prompts x G=4 completions of <= 8 tokens a step,
# two micro-batches (so accumulation is used), a checkpoint every step, nothing but metrics.jsonl logged.
RECIPE = """\
# The reliability suite's recipe (model.name_or_path and train.output_dir come as overrides).
data:
  train: synthetic:seed=1,n=32
rollout:
  num_generations: 4
  max_completion_length: 8
optim:
  learning_rate: 1.0e-3
train:
  prompts_per_step: 2
  micro_batch_size: 4
  max_steps: 2
  save_steps: 1
  seed: 0
log:
  report_to: []
  progress_bar: false
  plots: false
  num_samples: 8
rewards:
  - {name: 'rewards_for_tests:letters'}
  - {name: answer_correct}
"""


def run_args(model_dir: Path, out: Path, **extra) -> list[str]:
    """``key=value`` overrides for a tiny run of ``model_dir`` into ``out``; ``extra`` adds or replaces."""
    return as_overrides({"model.name_or_path": model_dir, "train.output_dir": out, **extra})


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path: equal snapshots = byte-identical trees."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
