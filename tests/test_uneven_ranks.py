"""A step split over trainer ranks unevenly (decoupled partial rollouts: a step holds a varying number of whole
groups): the split (grpo.step.batching.rank_group_spans), the loss scale that makes DDP's mean of the ranks'
gradients the whole batch's (LossAggregation.rank_scale) against a plain loop, and two real gloo ranks with 3
and 2 groups (so 3 and 2 micro-batches) whose update equals one process's on the whole batch."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from step_helpers import random_batch, run_spawned_ranks, settings_with
from transport_helpers import free_port

from grpo.algorithm import loss_aggregation, policy_loss
from grpo.step.batching import rank_group_spans, select_groups
from grpo.step.metrics import reduce_updates
from grpo.step.records import UpdateStats

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TIMEOUT_S = 300  # a bound against a hang only


@pytest.mark.parametrize("groups, ranks, sizes", [(5, 2, [3, 2]), (4, 2, [2, 2]), (7, 3, [3, 2, 2]),
                                                  (3, 3, [1, 1, 1]), (9, 4, [3, 2, 2, 2]), (6, 1, [6])])
def test_groups_are_split_in_rank_order_as_evenly_as_whole_groups_allow(groups, ranks, sizes):
    spans = rank_group_spans(groups, ranks)
    assert [len(s) for s in spans] == sizes
    assert [g for s in spans for g in s] == list(range(groups))  # every group once, consecutive, in rank order


def test_fewer_groups_than_ranks_is_an_error_not_an_empty_rank():
    with pytest.raises(ValueError, match="1 groups cannot be split over 2 ranks"):
        rank_group_spans(1, 2)


def test_rank_scales_of_a_hand_counted_split():
    # 10 rows over 2 ranks: 6 and 4, 5 per rank on average; 30 loss tokens: 12 and 18, 15 on average.
    mean_rows, mean_tokens = 5.0, torch.tensor(15.0)
    for loss_type, want in (("grpo", (1.2, 0.8)), ("dr_grpo", (1.2, 0.8)), ("bnpo", (0.8, 1.2)), ("dapo", (1.0, 1.0))):
        agg = loss_aggregation(loss_type)
        got = (agg.rank_scale(6, mean_rows, torch.tensor(12.0), mean_tokens),
               agg.rank_scale(4, mean_rows, torch.tensor(18.0), mean_tokens))
        assert [float(g) for g in got] == pytest.approx(want, abs=1e-7), loss_type
    assert loss_aggregation("grpo").rank_scale(5, 5.0, torch.tensor(3.0), mean_tokens) == 1.0  # even: exactly 1


def loop_loss(logprobs, old, advantages, mask, loss_type, max_len, epsilon=0.2):
    """The whole batch's clipped surrogate (beta 0), token by token in plain Python: the slow reference."""
    N, L = mask.shape
    per_row, total, tokens = [], 0.0, 0
    for i in range(N):
        row_sum, row_tokens = 0.0, 0
        for t in range(L):
            if mask[i, t]:
                ratio = torch.exp(logprobs[i, t] - old[i, t])
                objective = torch.minimum(ratio * advantages[i], ratio.clamp(1 - epsilon, 1 + epsilon) * advantages[i])
                row_sum, row_tokens = row_sum - objective, row_tokens + 1
        per_row.append(row_sum / max(row_tokens, 1))
        total, tokens = total + row_sum, tokens + row_tokens
    if loss_type == "grpo":
        return sum(per_row) / N
    if loss_type == "dr_grpo":
        return total / (N * max_len)
    return total / max(tokens, 1)  # bnpo and dapo: the batch's token mean


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mean_of_the_scaled_rank_gradients_is_the_whole_batch_gradient(loss_type, seed):
    gen = torch.Generator().manual_seed(seed)
    N, L, W = 10, 6, 2
    lengths = torch.randint(1, L + 1, (N,), generator=gen)
    mask = (torch.arange(L)[None] < lengths[:, None]).float()  # [N, L]
    old = -torch.rand(N, L, generator=gen)
    logprobs = (old + 0.3 * torch.randn(N, L, generator=gen)).requires_grad_()  # ratios inside and outside the clip
    advantages = torch.randn(N, generator=gen)
    want = torch.autograd.grad(loop_loss(logprobs, old, advantages, mask, loss_type, L), logprobs)[0]
    agg = loss_aggregation(loss_type)
    mean_tokens, ranks = mask.sum() / W, (range(0, 6), range(6, 10))  # 3 groups of 2 and 2 groups of 2

    def rank_losses(scaled: bool):
        losses = []
        for rows in ranks:
            rows = list(rows)
            loss, _ = policy_loss(logprobs[rows], old[rows], None, advantages[rows], mask[rows], beta=0.0,
                                  loss_type=loss_type, max_completion_length=L, normalizer=mean_tokens)
            scale = agg.rank_scale(len(rows), N / W, mask[rows].sum(), mean_tokens) if scaled else 1.0
            losses.append(loss * scale)
        return sum(losses) / W  # DDP averages the ranks' gradients

    got = torch.autograd.grad(rank_losses(scaled=True), logprobs)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if loss_type != "dapo":  # unscaled, the ranks' own means weigh 3 groups as 2: a different gradient
        assert (torch.autograd.grad(rank_losses(scaled=False), logprobs)[0] - want).abs().max() > 1e-3


def test_update_metrics_weigh_each_rank_by_its_share_but_the_scaled_loss():
    def update(loss, kl, share):
        stats = UpdateStats(loss=loss, policy_loss=loss, clip_fraction=kl, vespo_phi_mean=0.0, kl=kl, entropy=kl,
                            ratio_mean=kl, clip_low=0, clip_high=0, clip_region=0, clip_units=1, clip_low_row_min=0.0,
                            clip_high_row_max=0.0, grad_norm=1.0, learning_rate=0.1, seconds=1.0)
        return {**asdict(stats), "rank_share": share}

    (row,) = reduce_updates([[update(0.6, 1.0, 1.2)], [update(0.2, 2.0, 0.8)]])
    assert row["kl"] == pytest.approx((6 * 1.0 + 4 * 2.0) / 10) and row["entropy"] == row["kl"]
    assert row["clip_fraction"] == row["kl"]
    assert row["loss"] == row["policy_loss"] == pytest.approx(0.4)  # each rank's loss is already its part of the step's: a plain mean
    (plain,) = reduce_updates([[{k: v for k, v in update(0.6, 1.0, 1.0).items() if k != "rank_share"}],
                               [update(0.2, 2.0, 1.0)]])
    assert plain["kl"] == 1.5


def test_the_trainer_ranks_take_an_uneven_split_only_with_partial_rollouts():
    from grpo.decoupled.link_settings import ReceivingSettings
    from grpo.decoupled.trainer_role import Receiving
    from grpo.parallel.distributed import DistInfo

    batch = random_batch(vocab=50, N=10)  # 5 groups of 2
    for partial, rank, rows, share in ((True, 0, [0, 1, 2, 3, 4, 5], 1.2), (True, 1, [6, 7, 8, 9], 0.8)):
        settings = ReceivingSettings(trainer_ranks=2, max_staleness=1, peer_timeout_s=60, max_message_bytes=1 << 20,
                                     sync_steps=1, weights_keep=1, partial_rollouts=partial)
        receiving = Receiving(settings, None, None, None, DistInfo(rank, 2, rank), torch.device("cpu"), 0, 0)
        mine, got_share = receiving.rank_part(batch)
        assert torch.equal(mine.rewards, batch.rewards[rows]) and got_share == pytest.approx(share)
    even = Receiving(ReceivingSettings(2, 1, 60, 1 << 20, 1, 1), None, None, None, DistInfo(1, 2, 1),
                     torch.device("cpu"), 0, 0)
    with pytest.raises(ValueError, match="5 prompts cannot be split over 2 ranks"):
        even.rank_part(batch)


# ---------------------------------------------------------------- two gloo ranks against one process

CASES = [(loss_type, 1, True) for loss_type in LOSS_TYPES] + [("grpo", 2, True), ("grpo", 1, False)]


def updated_weights(loss_type: str, iterations: int, uneven: bool, info, groups=None) -> tuple[dict, dict]:
    """The tiny model's weights after one step of plain SGD on the batch's ``groups`` (all: one process), and
    the step's logged loss and reward mean over the ranks."""
    import time

    from grpo.models.tiny import build_qwen2, build_tokenizer
    from grpo.parallel.learners import TorchLearner
    from grpo.step.metrics import step_metrics
    from grpo.step.policy_update import train_on_batch

    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tokenizer), N=10, seed=4)  # 5 groups of 2
    share = 1.0
    if groups is not None:
        batch, share = select_groups(batch, groups), len(groups) * info.world_size / 5
    module = torch.nn.parallel.DistributedDataParallel(model) if info.enabled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    learner = TorchLearner(module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)
    # micro-batches of one group: rank 0 runs 3, rank 1 runs 2
    settings = settings_with(loss_type=loss_type, num_iterations=iterations, micro_batch_size=2, uneven_ranks=uneven)
    stats = train_on_batch(learner, batch, settings, info)
    logged = step_metrics(batch, stats.totals, 2, "think", time.perf_counter(), 0.0, 0.0, info, rank_share=share)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, logged


def train_rank(rank: int, world: int, port: int, out: str) -> None:
    """One of ``world`` gloo ranks: its share of the 5 groups, every case; rank 0 saves the weights."""
    import torch.distributed as dist

    from grpo.parallel.distributed import DistInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        spans = rank_group_spans(5, world)
        results = [updated_weights(*case, DistInfo(rank, world, rank), spans[rank]) for case in CASES]
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_with_3_and_2_groups_update_as_one_process_on_the_whole_batch(tmp_path):
    from grpo.parallel.distributed import DistInfo

    port, out = free_port(), str(tmp_path / "rank0.pt")
    run_spawned_ranks(train_rank, 2, port, out, TIMEOUT_S)
    got = torch.load(out)
    for case, (ranked, ranked_logged) in zip(CASES, got):
        loss_type, iterations, uneven = case
        alone, logged = updated_weights(loss_type, iterations, False, DistInfo())
        gap = max((ranked[n] - alone[n]).abs().max().item() for n in alone)
        if uneven:
            assert gap < 1e-5, f"{case}: the ranks' weights differ from one process's by {gap}"
            for key in ("loss", "reward/mean", "reward/std"):  # the step's, not the ranks' plain mean
                assert ranked_logged[key] == pytest.approx(logged[key], abs=1e-6), (case, key)
        else:  # without the scale the 3-group rank's mean weighs as much as the 2-group rank's
            assert gap > 1e-4, f"{case}: an unscaled uneven split gave the whole batch's update"
