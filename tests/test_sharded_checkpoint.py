"""FSDP2's sharded checkpoints (``grpo.run.sharded_checkpoint``): what 2 ranks write, 3 ranks read back exactly
(weights and AdamW's moments, gathered whole and compared bit for bit), and what those 3 write, 1 rank reads back;
one process without a process group reads the weights into a plain model (``grpo export``); a torn folder or one
of another model is an error naming the folder."""

from __future__ import annotations

import pytest
import torch
from step_helpers import run_spawned_ranks
from transport_helpers import free_port

from grpo.run.sharded_checkpoint import ShardedCheckpointError, load_sharded, load_weights, save_sharded

TIMEOUT_S = 300  # a bound against a hang only


def tiny(hidden: int = 32) -> torch.nn.Module:
    from grpo.models.tiny import build_qwen2, build_tokenizer

    return build_qwen2(build_tokenizer(), hidden_size=hidden, num_layers=2, seed=0)


def sharded_with_optimizer(seed: int | None):
    """The tiny model sharded over the ranks with its AdamW; ``seed``: one step first (its ids from the seed and
    this rank, so the moments are not those of any one rank's data)."""
    import torch.distributed as dist

    from grpo.parallel.fsdp import FsdpSettings, device_mesh, shard

    model = shard(tiny(), FsdpSettings(), device_mesh("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if seed is not None:
        ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(seed + dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def gathered_state(model, optimizer) -> dict:
    """The full weights and optimizer state on rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_state, "optimizer": optim_state.get("state", {})}  # {} but on rank 0


def _ranks(rank: int, world: int, port: int, out: str, act) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        state = act(out)
        if rank == 0:
            torch.save(state, f"{out}/gathered-{world}.pt")
    finally:
        dist.destroy_process_group()


def _write(out: str) -> dict:
    model, optimizer = sharded_with_optimizer(seed=7)
    save_sharded(f"{out}/by-2", model, optimizer)
    return gathered_state(model, optimizer)


def _read_and_write(out: str) -> dict:
    import torch.distributed as dist

    model, optimizer = sharded_with_optimizer(seed=None)
    source, target = ("by-2", "by-3") if dist.get_world_size() == 3 else ("by-3", None)
    load_sharded(f"{out}/{source}", model, optimizer)
    if target is not None:
        save_sharded(f"{out}/{target}", model, optimizer)
    return gathered_state(model, optimizer)


def write_on(rank, world, port, out):
    _ranks(rank, world, port, out, _write)


def read_on(rank, world, port, out):
    _ranks(rank, world, port, out, _read_and_write)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """The gathered state after 2 ranks wrote it, 3 ranks read it (and wrote it again), 1 rank read that."""
    out = tmp_path_factory.mktemp("dcp")
    run_spawned_ranks(write_on, 2, free_port(), str(out), TIMEOUT_S)
    run_spawned_ranks(read_on, 3, free_port(), str(out), TIMEOUT_S)
    run_spawned_ranks(read_on, 1, free_port(), str(out), TIMEOUT_S)
    return out, {world: torch.load(out / f"gathered-{world}.pt") for world in (2, 3, 1)}


def _assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert set(got["model"]) == set(want["model"]) and set(got["optimizer"]) == set(want["optimizer"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), f"{what}: weight {name}"
    for name, moments in want["optimizer"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(got["optimizer"][name][key]), torch.as_tensor(moments[key])), \
                f"{what}: {key} of {name}"


def test_two_ranks_shards_load_exactly_on_three_ranks_and_theirs_on_one(resharded):
    _, states = resharded
    written = states[2]
    assert any(m["exp_avg"].abs().sum() > 0 for m in written["optimizer"].values())  # one step was taken
    _assert_equal_states(states[3], written, "2 -> 3 ranks")
    _assert_equal_states(states[1], written, "3 -> 1 rank")


def test_one_process_reads_the_weights_into_a_plain_model_without_a_process_group(resharded):
    out, states = resharded
    model = tiny()
    load_weights(out / "by-3", model)
    own = model.state_dict()
    for name, tensor in states[2]["model"].items():
        assert torch.equal(own[name], tensor), name


def test_a_torn_folder_or_another_models_is_an_error_naming_the_folder(resharded, tmp_path):
    out, _ = resharded
    with pytest.raises(ShardedCheckpointError, match=f"{tmp_path}.*not a whole sharded checkpoint"):
        load_weights(tmp_path, tiny())
    with pytest.raises(ShardedCheckpointError, match=r"by-2: its model weights do not load into Qwen2ForCausalLM"):
        load_weights(out / "by-2", tiny(hidden=48))
