"""The FSDP2 learner (``grpo.parallel.fsdp``): one update on two gloo ranks, each holding half of a step's groups and
half of every parameter, equals one process's update on the whole batch (the step's loss, the gradient norm and
every weight, within float tolerance), for full fine-tuning and LoRA, with and without gradient checkpointing and
CPU offload, with the fused LM head on tied and untied heads, and with the gradient accumulated unsharded. The
ranks run in one pair of spawned processes for every case (each case is one tiny model and one step)."""

from __future__ import annotations

import time

import pytest
import torch
from step_helpers import random_batch, run_spawned_ranks, settings_with
from transport_helpers import free_port

from grpo.config import ConfigError, ModelConfig
from grpo.parallel.fsdp import FsdpSettings, layer_modules
from grpo.step.batching import rank_group_spans, select_groups
from grpo.step.logprob_pass import LogprobPass

TIMEOUT_S = 600  # a bound against a hang only
CLIP = 1e-3  # max_grad_norm, below every case's gradient norm
FUSED = LogprobPass(fused_head=True)  # the LM head called on the hidden states, outside the model's forward
# name: (model config, FSDP settings, loss-settings changes, untied head)
CASES = {
    "full": (ModelConfig(), FsdpSettings(), {}, False),
    "full, checkpointing, offload": (ModelConfig(gradient_checkpointing=True), FsdpSettings(cpu_offload=True), {},
                                     False),
    "full, fused head, untied": (ModelConfig(), FsdpSettings(), {"logprob_pass": FUSED}, True),
    "full, fused head, accumulated unsharded, 2 iterations": (
        ModelConfig(), FsdpSettings(accumulate_unsharded=True, reshard_after_forward=False),
        {"logprob_pass": FUSED, "num_iterations": 2}, False),
    "lora": (ModelConfig(lora_r=4, lora_target_modules=["q_proj", "v_proj"]), FsdpSettings(), {}, False),
    "lora, checkpointing, offload": (ModelConfig(lora_r=4, lora_target_modules=["q_proj", "v_proj"],
                                                 gradient_checkpointing=True), FsdpSettings(cpu_offload=True), {},
                                     False),
}


def tiny_policy(model_cfg: ModelConfig, untied: bool) -> torch.nn.Module:
    """The tiny 2-layer Qwen2 (the same weights every call), made a policy as a run makes it (checkpointing,
    LoRA with a seeded adapter)."""
    from grpo.models.loading import prepare_policy
    from grpo.models.tiny import build_qwen2, build_tokenizer

    model = build_qwen2(build_tokenizer(), hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=not untied)
    torch.manual_seed(1)  # LoRA's A matrices
    return prepare_policy(model, model_cfg)


def one_update(name: str, info, groups=None) -> tuple[dict, dict, float]:
    """The trained weights after one update of case ``name`` (SGD: the weights move by the clipped gradient, the clip
    max_grad_norm 1e-3 active, times 100), the step's logged loss and the gradient norm; on two ranks (``groups``: this rank's) under FSDP2, else
    one process with the torch learner."""
    from grpo.models.tiny import build_tokenizer
    from grpo.parallel.fsdp import FsdpLearner, device_mesh, full_state_dict, shard
    from grpo.parallel.learners import TorchLearner
    from grpo.step.metrics import step_metrics
    from grpo.step.policy_update import train_on_batch

    model_cfg, fsdp, changes, untied = CASES[name]
    model = tiny_policy(model_cfg, untied)
    batch = random_batch(len(build_tokenizer()), N=8, seed=4)  # 4 groups of 2
    if groups is not None:
        batch = select_groups(batch, groups)
        shard(model, fsdp, device_mesh("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=100.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = (FsdpLearner(model, optimizer, scheduler, CLIP, fsdp.accumulate_unsharded) if groups is not None
               else TorchLearner(model, optimizer, scheduler, CLIP))
    settings = settings_with(micro_batch_size=2, max_grad_norm=CLIP, equal_micro_batches=groups is not None,
                             **changes)
    stats = train_on_batch(learner, batch, settings, info)
    logged = step_metrics(batch, stats.totals, 2, "think", time.perf_counter(), 0.0, 0.0, info)
    weights = (full_state_dict(model) if groups is not None else
               {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad or not model_cfg.lora_r})
    return weights, logged, stats.totals["grad_norm"]


def fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo ranks: its half of the 4 groups, every case; rank 0 saves the results."""
    import torch.distributed as dist

    from grpo.parallel.distributed import DistInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        spans = rank_group_spans(4, world)
        results = {name: one_update(name, DistInfo(rank, world, rank), spans[rank]) for name in CASES}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp") / "rank0.pt")
    run_spawned_ranks(fsdp_rank, 2, free_port(), out, TIMEOUT_S)
    return torch.load(out)


@pytest.mark.parametrize("name", list(CASES))
def test_two_fsdp_ranks_update_as_one_process_on_the_whole_batch(two_ranks, name):
    from grpo.parallel.distributed import DistInfo

    sharded, sharded_logged, sharded_norm = two_ranks[name]
    alone, logged, norm = one_update(name, DistInfo())
    assert set(sharded) == set(alone)  # a tied head once, under the embedding's name; LoRA: the adapter only
    assert sharded_norm == pytest.approx(norm, rel=1e-5)
    assert norm > CLIP, "the clip must be active for the test to cover it"
    assert sharded_logged["loss"] == pytest.approx(logged["loss"], abs=1e-6)
    for key in sharded:
        torch.testing.assert_close(sharded[key], alone[key], atol=2e-5, rtol=0, msg=f"{name}: {key}")
    initial = tiny_policy(CASES[name][0], CASES[name][3]).state_dict()
    # LoRA's A gets no gradient while B is still 0: B must move, as every weight of full fine-tuning
    must_move = [k for k in sharded if "lora_A" not in k]
    unchanged = [k for k in must_move if torch.equal(sharded[k], initial[k])]
    assert must_move and not unchanged, f"{name}: unchanged after the update: {unchanged}"


def test_the_layers_are_found_by_the_models_own_no_split_modules_or_by_name():
    model = tiny_policy(ModelConfig(lora_r=4, lora_target_modules=["q_proj"]), False)  # through peft's wrapper
    assert [type(m).__name__ for m in layer_modules(model)] == ["Qwen2DecoderLayer"] * 2
    assert len(layer_modules(model, ("Qwen2MLP",))) == 2
    with pytest.raises(ConfigError, match=r"fsdp.layer_classes: no module .*\['GPT2Block'\].*Qwen2DecoderLayer"):
        layer_modules(model, ("GPT2Block",))
    model.get_base_model()._no_split_modules = []
    with pytest.raises(ConfigError, match=r"^train.fsdp: no module .*_no_split_modules is empty"):
        layer_modules(model)


def test_a_torch_without_fsdp2_is_a_config_error_naming_the_key(monkeypatch):
    import grpo.parallel.fsdp as fsdp

    monkeypatch.setattr(fsdp, "torch_fsdp", None)
    with pytest.raises(ConfigError, match=r"^train.fsdp: torch .* has no FSDP2 \(no torch.distributed.fsdp\)"):
        fsdp.check_fsdp_available()
