"""docs/guides/scale.md's table is what benchmarks/scale_on_paper.py prints (grpo memory's estimates for a 30B MoE
and a 70B dense model on 8 x 80 GB), so the page cannot drift from the planner; and the estimates keep the
structure the page's conclusions rest on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import scale_on_paper  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return [scale_on_paper.estimate(setup) for setup in scale_on_paper.SETUPS]


def test_the_scale_page_holds_the_scripts_table(rows):
    page = (REPO / "docs" / "guides" / "scale.md").read_text()
    assert scale_on_paper.table(rows) in page, "rerun python benchmarks/scale_on_paper.py and paste its table"


def test_the_moe_trains_decoupled_without_kl_and_the_dense_70b_is_held_back_by_its_sampler(rows):
    by = {(r["model"].split("/")[1], r["setup"]): r for r in rows}
    moe = by["Qwen3-30B-A3B", "full, FSDP2, decoupled, beta 0"]
    assert moe["trains"] and moe["peak_phase"] == "update"
    # the sampler holds the bf16 weights (2 B x 30.5B) and the rollout's tensors; with a KL term the reference too
    weights_gb = 30_532_122_624 * 2 / 2**30
    assert weights_gb < moe["sampler_gb"] < by["Qwen3-30B-A3B", "full, FSDP2, decoupled"]["sampler_gb"] - weights_gb
    assert not by["Qwen3-30B-A3B", "full, FSDP2, colocated"]["trains"]  # the rollout gathers the whole model
    offload = by["Llama-3.1-70B-Instruct", "full, FSDP2 + CPU offload, decoupled, beta 0"]
    assert offload["trainer_fits"] and not offload["sampler_fits"]  # 141 GB of bf16 weights on one sampler GPU
    assert offload["host_gb"] == pytest.approx(70_553_706_496 * 16 / 2**30)
