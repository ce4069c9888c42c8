"""Partial rollouts under DeepSpeed (issue 45): trainer ranks holding different numbers of groups run as many
micro-batches as the rank with the most (zero-gradient padding ones), and the learner sets the accumulation
boundary at the update's last micro-batch instead of DeepSpeed's fixed count. Two real gloo ranks with 3 and 2
groups under ZeRO-2 and ZeRO-3 end each update with the weights one process makes on all 5 (the DDP version:
tests/test_uneven_ranks.py); the padding itself against the unpadded update in one process."""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from step_helpers import random_batch, run_spawned_ranks, settings_with
from transport_helpers import free_port

from grpo.parallel.distributed import DistInfo
from grpo.step.batching import rank_group_spans, select_groups
from grpo.step.policy_update import policy_backward
from grpo.step.update_inputs import prepare_batch
from grpo.step.update_stats import StepStats

TIMEOUT_S = 300  # a bound against a hang only
STAGES = (2, 3)
ITERATIONS = 2  # two updates: the schedule must move once per update, not per micro-batch
# DeepSpeed's nominal count, which neither the ranks' 3 micro-batches (rank 1: 2 + 1 padding) nor the whole batch's 5
# match: only the boundary the learner sets makes each update the whole step's.
ACCUMULATION = 2
MAX_GRAD_NORM = 0.05  # below the updates' gradient norms (checked), so that clipping binds


def halving(update: int) -> float:
    return 0.5 ** update


def tiny_model():
    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer = build_tokenizer()
    return build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0), len(tokenizer)


def step_settings(**changes):
    # micro-batches of one group (2 rows): rank 0 runs 3, rank 1 runs 2 of its own
    return settings_with(loss_type="grpo", num_iterations=ITERATIONS, micro_batch_size=2, **changes)


class FlagLearner:
    """Plain backward (the gradient accumulates in the module), recording each micro-batch's ``last`` flag."""

    def __init__(self, module):
        self.module, self.flags = module, []

    def accumulating(self, last):
        self.flags.append(last)
        return nullcontext()

    def backward(self, loss):
        loss.backward()


def step_stats(inputs) -> StepStats:
    return StepStats(1, torch.device("cpu"), sampler_is=False, ptx=False, mismatch=inputs.reported_logprobs is not None)


def test_padding_micro_batches_add_no_gradient_and_the_last_of_them_closes_the_update():
    model, vocab = tiny_model()
    batch = replace(random_batch(vocab, N=4, seed=4), old_logprobs=None)  # ratios 1: every token has gradient
    inputs = prepare_batch(batch, step_settings(), DistInfo(), torch.device("cpu"))
    assert len(inputs.micro_batches) == 2 and inputs.padding == 0  # one process: nothing to match
    runs = []
    for padding in (0, 2):
        learner = FlagLearner(model)
        stats = step_stats(inputs)
        policy_backward(learner, replace(inputs, padding=padding), None, step_settings(), stats, 0,
                        closes_update=True, keep_old=False)
        runs.append((learner.flags, {n: p.grad.clone() for n, p in model.named_parameters()},
                     {k: v for k, v in stats.result(0.0).totals.items() if k != "grad_norm"}))  # nan: no update
        model.zero_grad(set_to_none=True)
    (flags, grads, totals), (padded_flags, padded_grads, padded_totals) = runs
    assert flags == [False, True] and padded_flags == [False, False, False, True]  # the boundary moves to the last
    assert all(torch.equal(grads[n], padded_grads[n]) for n in grads)  # exactly: weight 0, not a small one
    assert padded_totals == totals  # the padding is no part of the step's statistics
    # with a PTX micro-batch to follow, it closes the update: no policy micro-batch does, padding included
    learner = FlagLearner(model)
    policy_backward(learner, replace(inputs, padding=1), None, step_settings(), step_stats(inputs), 0,
                    closes_update=False, keep_old=False)
    assert learner.flags == [False, False, False]


# ---------------------------------------------------------------- two gloo ranks under ZeRO-2/3 against one process


def step_batch(vocab: int):
    """5 groups of 2 rows without old log-probs: the first update's ratios are 1, so every token carries gradient
    (random old log-probs would clip most of them, and a padding row's gradient could be 0 by chance)."""
    return replace(random_batch(vocab, N=10, seed=4), old_logprobs=None)


def deepspeed_update(stage: int, info: DistInfo, groups) -> dict:
    """One step (``ITERATIONS`` plain-SGD updates) of a ZeRO-``stage`` engine on the batch's ``groups``: the full
    weights (rank 0), the engine's counters and the rate the schedule reached."""
    from grpo.parallel.learners import build_learner, zero3_full_state_dict
    from grpo.step.policy_update import train_on_batch

    model, vocab = tiny_model()
    batch = select_groups(step_batch(vocab), groups)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, halving)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
              "train_batch_size": 2 * ACCUMULATION * info.world_size, "gradient_clipping": MAX_GRAD_NORM,
              "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}, "steps_per_print": 10**9}
    learner = build_learner(model, optimizer, scheduler, ddp=False, deepspeed_config_dict=config, max_grad_norm=None)
    step = train_on_batch(learner, batch, step_settings(uneven_ranks=True, equal_micro_batches=True), info)
    weights = zero3_full_state_dict(learner)
    if weights is None:
        weights = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    return {"weights": weights, "global_steps": learner.engine.global_steps,
            "micro_steps": learner.engine.micro_steps, "lr": learner.lr,
            "grad_norms": [update.grad_norm for update in step.updates]}


def train_rank(rank: int, world: int, port: int, out: str) -> None:
    """One of ``world`` gloo ranks: its share of the 5 groups under each ZeRO stage; each rank saves its results."""
    import torch.distributed as dist

    os.environ.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a short timeout: ranks whose collectives do not match fail instead of waiting half an hour
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        mine = rank_group_spans(5, world)[rank]
        torch.save({stage: deepspeed_update(stage, DistInfo(rank, world, rank), mine) for stage in STAGES},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    # With DeepSpeed 0.18.0 a rank's interpreter teardown sometimes aborts after all this ("terminate called without
    # an active exception", 2 runs in 8 here); the results are saved, so the rank leaves without it.
    os._exit(0)


def one_process_update() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same step in one process on the whole batch, plain torch: the reference weights and gradient norms."""
    from grpo.parallel.learners import TorchLearner
    from grpo.step.policy_update import train_on_batch

    model, vocab = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    learner = TorchLearner(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, halving), MAX_GRAD_NORM)
    step = train_on_batch(learner, step_batch(vocab), step_settings(), DistInfo())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [update.grad_norm for update in step.updates]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    """Each rank's ``deepspeed_update`` results by ZeRO stage, from two gloo ranks holding 3 and 2 of 5 groups."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (make install installs it)")
    port, out = free_port(), str(tmp_path_factory.mktemp("uneven-deepspeed") / "rank")
    run_spawned_ranks(train_rank, 2, port, out, TIMEOUT_S)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_ranks_with_3_and_2_groups_update_as_one_process_on_the_whole_batch(rank_results, stage):
    for rank, results in enumerate(rank_results):
        got = results[stage]
        # every rank ran 3 micro-batches per update (rank 1: one of padding) and stepped once per update
        assert (got["global_steps"], got["micro_steps"]) == (ITERATIONS, 3 * ITERATIONS), rank
        assert got["lr"] == halving(ITERATIONS), rank
    (alone, norms), weights = one_process_update(), rank_results[0][stage]["weights"]  # ZeRO-3: gathered on rank 0
    assert min(norms) > MAX_GRAD_NORM  # clipped: the update is DeepSpeed's clipping of the whole batch's gradient
    for results in rank_results:  # the global norm before clipping, on every rank
        assert results[stage]["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert set(weights) == set(alone)
    gap = max((weights[n] - alone[n]).abs().max().item() for n in alone)
    assert gap < 1e-5, f"ZeRO-{stage}: the ranks' weights differ from one process's by {gap}"
