"""``grpo memory`` under ``train.fsdp`` (``grpo.commands.memory.fsdp_states``): each rank holds 1/N of the fp32
parameters, gradients and AdamW states, gathers the root unit and one layer (two on CUDA) in the update and every
unit while sampling; the reference is sharded too. Checked by hand on Qwen2.5-3B's shape; the estimate against the
measured CPU peaks of real runs at 1, 2 and 3 ranks is benchmarks/fsdp_memory.py's (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from grpo.commands.memory import ModelShape, estimate_memory
from grpo.commands.memory.shapes import load_model_config
from grpo.config import load_config

QWEN3B = "Qwen/Qwen2.5-3B-Instruct"
BASE = [f"model.name_or_path={QWEN3B}", "model.bf16=true", "model.gradient_checkpointing=true",
        "train.micro_batch_size=4", "data.max_prompt_length=256", "rollout.max_completion_length=512",
        "rollout.engine=hf", "train.fsdp=true"]
GIB = 1024**3


def estimate(*overrides: str, gpus: int = 1, device: str = "cuda"):
    return estimate_memory(load_config(None, [*BASE, *overrides]), gpus=gpus, device=device)


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    config, _ = load_model_config(QWEN3B, "model.name_or_path")
    return ModelShape.from_config(config, QWEN3B)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_each_rank_holds_a_shard_of_the_fp32_states_and_gathers_the_root_and_two_layers(shape, gpus):
    est = estimate(gpus=gpus)
    n, layer = shape.num_params(), shape.layer_params()
    root = n - shape.num_layers * layer  # tied embeddings (3B) + final norm
    # fp32 master shards + bf16 root and two layers (CUDA prefetches the next) gathered
    assert est.per_device_gb["weights"] == pytest.approx((4 * n / gpus + 2 * (root + 2 * layer)) / GIB, abs=2e-3)
    # fp32 gradient shards + the embedding's unsharded bf16 gradient during the backward
    assert est.per_device_gb["gradients"] == pytest.approx((4 * n / gpus + 2 * shape.embedding_params()) / GIB,
                                                           abs=2e-3)
    assert est.per_device_gb["optimizer"] == pytest.approx(8 * n / gpus / GIB, abs=2e-3)  # m + v, no second master
    assert est.per_device_gb["reference"] == pytest.approx(2 * n / gpus / GIB, abs=2e-3)  # bf16 reference, sharded


def test_parameters_and_adamw_per_rank_are_ddps_over_n_plus_the_gathered_units(shape):
    ddp = estimate("train.fsdp=false", gpus=1)
    ddp_states = (ddp.per_device_gb["weights"] + ddp.per_device_gb["optimizer"]) * GIB
    for gpus in (2, 3, 8):
        fsdp = estimate(gpus=gpus)
        states = (fsdp.per_device_gb["weights"] + fsdp.per_device_gb["optimizer"]) * GIB
        gathered = 2 * (shape.num_params() - shape.num_layers * shape.layer_params() + 2 * shape.layer_params())
        assert states <= ddp_states / gpus + gathered + 1e6  # the goal: 1/N of DDP's + what is gathered


def test_sampling_gathers_every_unit_and_the_optimizer_step_none(shape):
    est = estimate(gpus=4, device="cpu")
    parts = est.per_device_gb
    gathered_in_update = 2 * (shape.num_params() - shape.num_layers * shape.layer_params() + shape.layer_params())
    shards = parts["weights"] * GIB - gathered_in_update
    # the rollout holds the whole policy and reference in bf16 beside the shards
    assert est.phases_gb["rollout"] * GIB > shards + 2 * 2 * shape.num_params()
    # the optimizer step: shards, gradient shards, AdamW, reference shard and CPU AdamW's temporary of the largest
    # tensor's shard (the embedding's)
    step = (shards + 4 * shape.num_params() / 4 + parts["optimizer"] * GIB + parts["reference"] * GIB
            + 4 * shape.embedding_params() / 4)
    assert est.phases_gb["optimizer_step"] * GIB == pytest.approx(step, rel=0.01)


def test_cpu_offload_leaves_only_the_gathered_units_on_the_device_and_unsharded_accumulation_keeps_them(shape):
    offloaded = estimate("fsdp.cpu_offload=true", gpus=4)
    assert offloaded.per_device_gb["optimizer"] == 0
    n = shape.num_params()
    assert offloaded.per_device_gb["weights"] * GIB < 2 * n / 4  # less than a bf16 quarter of the model
    unsharded = estimate("fsdp.accumulate_unsharded=true", gpus=4)
    assert unsharded.per_device_gb["weights"] * GIB == pytest.approx(4 * n / 4 + 2 * n, rel=1e-3)
    assert unsharded.per_device_gb["gradients"] * GIB == pytest.approx(2 * n, rel=1e-3)  # no shards yet


def test_lora_shards_the_bf16_base_and_trains_only_the_adapters(shape):
    est = estimate("model.lora_r=16", gpus=2)
    trained = est.assumptions["trained_params"]
    assert est.per_device_gb["optimizer"] == pytest.approx(8 * trained / 2 / GIB, abs=1e-3)
    assert est.per_device_gb["reference"] == 0  # the adapter disabled
    assert "FSDP2 shards" in est.how["weights"] and est.assumptions["fsdp"]
