"""`from grpo import GRPOConfig, GRPOTrainer` loads no library that only a feature the script may not use needs
(tests/test_layers.py's ON_FIRST_USE): a notebook pays for its imports on every kernel start, and TRL scripts of
three steps spend as long importing as training (docs/guides/python-api.md, the cost of a short script)."""

from __future__ import annotations

import json
import subprocess
import sys

from test_layers import ON_FIRST_USE

PROBE = """
import json, sys
from grpo import GRPOConfig, GRPOTrainer
print(json.dumps(sorted(sys.modules)))
"""
# What the model classes grpo cannot do without load by themselves (transformers >= 5.24's modeling_utils imports
# torch.distributed.checkpoint): not grpo's to defer.
BASELINE = """
import json, sys
import transformers.modeling_utils
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_api_import_loads_none_of_the_first_use_libraries():
    loaded = _loaded_by(PROBE)
    assert "grpo.api.trainer" in loaded  # the probe did import the trainer
    theirs = _loaded_by(BASELINE)
    assert not sorted(name for name in ON_FIRST_USE if name in loaded and name not in theirs)


def test_the_probe_sees_a_first_use_library_when_one_is_loaded():
    # The check above can fail: the same probe, after a feature that needs one of them, reports it.
    loaded = _loaded_by(PROBE.replace("print(", "import grpo.run.plots as p, pathlib, tempfile\n"
                                      "d = pathlib.Path(tempfile.mkdtemp()); (d / 'metrics.jsonl').write_text("
                                      "'{\"step\": 1, \"reward\": 0.5}\\n'); p.plot_run(d)\nprint("))
    assert "matplotlib" in loaded
