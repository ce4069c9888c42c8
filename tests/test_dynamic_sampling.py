"""Dynamic sampling (grpo.step.dynamic_sampling): the zero-spread filter, the choice and merge of groups over
rounds, the cap; the rounds' prompts and seeds as functions of (seed, step, rank, round); the config rules."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.data.prompt_sampler import PromptSampler, step_seed
from grpo.step.batching import select_groups
from grpo.step.dynamic_sampling import choose_groups, merge_rounds, sample_until_full, zero_spread_groups
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

G = 3


def scored_round(rewards: list[list[float]], tag: str, seconds: float = 1.0, metric: float | None = None,
                 Lc: int = 4) -> RolloutBatch:
    """A scored batch (as sample_and_score gives) with one group per inner list; row texts name the
    round and group, so a merged batch shows where each row came from."""
    P = len(rewards)
    N = P * G
    lengths = torch.tensor([1 + (i % Lc) for i in range(N)])
    mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    ids = torch.arange(N * Lc).view(N, Lc)
    return RolloutBatch(
        generation=Generation(prompt_ids=torch.full((N, 2), 7), prompt_mask=torch.ones(N, 2, dtype=torch.long),
                              completion_ids=ids, completion_mask=mask, truncated=torch.zeros(N, dtype=torch.bool),
                              completions=[f"{tag}:g{i // G}:c{i % G}" for i in range(N)]),
        rewards=torch.tensor([r for group in rewards for r in group]),
        reward_parts=torch.tensor([[r] for group in rewards for r in group]), reward_names=["r"],
        advantages=torch.zeros(N), old_logprobs=None, ref_logprobs=None,
        prompts=[f"{tag}:p{p}" for p in range(P)], columns={"answer": [f"{tag}:a{i // G}" for i in range(N)]},
        timings={"generate_s": seconds, "rewards_s": seconds / 10},
        reward_metrics={"judge/calls": metric} if metric is not None else {},
        reward_extras={"note": [f"{tag}:{i}" for i in range(N)]},
        sampler_logprobs=-(ids.float() / 100) * mask)


def test_zero_spread_groups_hand_case():
    # Groups of 3: all equal (1, 1, 1) -> dropped; (0, 1, 0) differs; (-1, -1, -1) dropped; a difference
    # of 1e-7 still counts (the advantage is non-zero, however small).
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, -1.0, -1.0, -1.0, 0.5, 0.5, 0.5 + 1e-7])
    assert zero_spread_groups(rewards, G).tolist() == [True, False, True, False]


def test_choose_groups_keeps_informative_groups_in_draw_order_then_fills():
    flags = [torch.tensor([True, False, True]), torch.tensor([False, True, False])]
    # Three informative groups: round 0's group 1, round 1's groups 0 and 2.
    assert choose_groups(flags, 2) == ([(0, 1), (1, 0)], 0)  # truncated to the batch
    assert choose_groups(flags, 3) == ([(0, 1), (1, 0), (1, 2)], 0)
    # One short: the first zero-spread group drawn (round 0, group 0) fills it.
    assert choose_groups(flags, 4) == ([(0, 1), (1, 0), (1, 2), (0, 0)], 1)
    with pytest.raises(ValueError, match="6 groups were drawn for a batch of 7"):
        choose_groups(flags, 7)


def test_select_groups_takes_whole_groups_with_their_texts_and_tensors():
    batch = scored_round([[0, 0, 0], [0, 1, 0], [2, 2, 3]], "r0")
    picked = select_groups(batch, [2, 1])
    rows = [6, 7, 8, 3, 4, 5]
    assert picked.prompts == ["r0:p2", "r0:p1"]
    assert picked.generation.completions == [batch.generation.completions[r] for r in rows]
    assert picked.columns["answer"] == ["r0:a2"] * 3 + ["r0:a1"] * 3
    assert picked.reward_extras["note"] == [f"r0:{r}" for r in rows]
    for name in ("completion_ids", "completion_mask", "prompt_ids"):
        assert torch.equal(getattr(picked.generation, name), getattr(batch.generation, name)[rows])
    assert torch.equal(picked.rewards, batch.rewards[rows])
    assert torch.equal(picked.sampler_logprobs, batch.sampler_logprobs[rows])
    assert picked.old_logprobs is None and picked.timings == batch.timings


def test_merge_rounds_sums_timings_and_averages_metrics_over_every_round():
    rounds = [scored_round([[1, 1, 1], [0, 1, 0]], "r0", seconds=2.0, metric=4.0),
              scored_round([[3, 3, 3], [5, 5, 5]], "r1", seconds=3.0, metric=8.0),  # nothing kept from it
              scored_round([[1, 2, 3], [0, 0, 0]], "r2", seconds=5.0)]  # no metric logged in this round
    merged = merge_rounds(rounds, [(0, 1), (2, 0), (0, 0)], pad_id=0)
    assert merged.prompts == ["r0:p1", "r2:p0", "r0:p0"]
    assert merged.rewards.tolist() == [0, 1, 0, 1, 2, 3, 1, 1, 1]
    assert merged.timings == {"generate_s": 10.0, "rewards_s": pytest.approx(1.0)}
    assert merged.reward_metrics == {"judge/calls": 6.0}  # (4 + 8) / 2: the rounds that logged it


def test_sample_until_full_stops_once_the_batch_is_full():
    plan = [[[1, 1, 1], [0, 1, 0], [2, 2, 2]],  # one informative group of 3 wanted
            [[0, 0, 1], [4, 4, 4], [1, 0, 0]],  # two more: full after round 1
            [[9, 8, 7], [9, 8, 7], [9, 8, 7]]]  # never drawn
    drawn = []

    def draw(k):
        drawn.append(k)
        return scored_round(plan[k], f"r{k}")

    batch, stats = sample_until_full(draw, want=3, max_rounds=3, pad_id=0)
    assert drawn == [0, 1]
    assert batch.prompts == ["r0:p1", "r1:p0", "r1:p2"]
    assert not zero_spread_groups(batch.rewards, G).any()
    assert stats == {"rollout/dynamic_rounds": 2.0, "rollout/dynamic_prompts_drawn": 6.0,
                     "rollout/dynamic_groups_dropped": 3.0, "rollout/dynamic_groups_surplus": 0.0,
                     "rollout/dynamic_groups_filled": 0.0, "rollout/dynamic_cap_hit": 0.0}


def test_sample_until_full_truncates_the_surplus_of_the_last_round():
    plan = [[[1, 1, 1], [0, 1, 0]], [[0, 0, 1], [1, 0, 0]]]
    batch, stats = sample_until_full(lambda k: scored_round(plan[k], f"r{k}"), want=2, max_rounds=5, pad_id=0)
    assert batch.prompts == ["r0:p1", "r1:p0"]
    assert stats["rollout/dynamic_groups_surplus"] == 1.0 and stats["rollout/dynamic_rounds"] == 2.0


def test_at_the_cap_the_batch_is_filled_with_zero_spread_groups_loudly():
    plan = [[[1, 1, 1], [0, 0, 0], [1, 0, 1]], [[2, 2, 2], [3, 3, 3], [4, 4, 4]]]
    with pytest.warns(RuntimeWarning, match="dynamic_sampling_max_rounds"):
        batch, stats = sample_until_full(lambda k: scored_round(plan[k], f"r{k}"), want=3, max_rounds=2, pad_id=0)
    assert batch.prompts == ["r0:p2", "r0:p0", "r0:p1"]  # the informative group, then the first dropped ones
    assert len(batch.rewards) == 3 * G
    assert stats["rollout/dynamic_groups_filled"] == 2.0 and stats["rollout/dynamic_cap_hit"] == 1.0
    assert stats["rollout/dynamic_groups_dropped"] == 5.0 and stats["rollout/dynamic_rounds"] == 2.0


# ---------------------------------------------------------------- prompts and seeds per round


def test_extra_prompts_are_a_function_of_seed_step_rank_and_round():
    W, P, rounds = 2, 4, 3
    first = PromptSampler(50, P, seed=3)
    drawn = {(step, rank, k): first.extra_indices(step, rank, W, k)
             for step in (1, 2, 7) for rank in range(W) for k in range(1, rounds + 1)}
    # A fresh sampler (a resumed run), asked in another order, draws the same prompts.
    again = PromptSampler(50, P, seed=3)
    for key in sorted(drawn, reverse=True):
        assert again.extra_indices(*key[:2], W, key[2]) == drawn[key], key
    for step in (1, 2, 7):
        blocks = [drawn[(step, rank, k)] for rank in range(W) for k in range(1, rounds + 1)]
        flat = [i for block in blocks for i in block]
        assert all(len(block) == P // W for block in blocks)
        # No two ranks or rounds share a prompt, and none repeats the step's own prompts.
        assert len(set(flat)) == len(flat) and not set(flat) & set(first.step_indices(step))
    assert drawn[(1, 0, 1)] != drawn[(2, 0, 1)]  # another step, other prompts
    assert PromptSampler(50, P, seed=4).extra_indices(1, 0, W, 1) != drawn[(1, 0, 1)]  # another seed


def test_extra_prompts_leave_the_ordinary_schedule_alone():
    plain, dynamic = PromptSampler(40, 4, seed=1), PromptSampler(40, 4, seed=1)
    for step in range(1, 25):
        dynamic.extra_indices(step, 0, 2, 1)
        dynamic.extra_indices(step, 1, 2, 2)
        for rank in range(2):
            assert dynamic.rank_indices(step, rank, 2) == plain.rank_indices(step, rank, 2)


def test_extra_prompts_wrap_around_a_small_dataset():
    sampler = PromptSampler(6, 4, seed=0)  # 2 prompts left besides the step's 4
    pool = set(range(6)) - set(sampler.step_indices(1))
    for k in (1, 2, 3):
        assert set(sampler.extra_indices(1, 0, 1, k)) == pool
    with pytest.raises(ValueError, match="round 0 is rank_indices"):
        sampler.extra_indices(1, 0, 1, 0)


def test_round_seeds_differ_and_round_zero_is_the_ordinary_seed():
    assert step_seed(42, 5, 1) == (42 * 1_000_003 + 5 * 1_009 + 1) % 2**63  # unchanged for existing runs
    assert step_seed(42, 5, 1, 0) == step_seed(42, 5, 1)
    seeds = {step_seed(42, step, rank, k) for step in (1, 2) for rank in (0, 1) for k in range(4)}
    assert len(seeds) == 16


# ---------------------------------------------------------------- config rules


def test_dynamic_sampling_is_refused_with_gae_and_with_colocated_deepspeed():
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling.*advantages come from the critic"):
        load_config(None, ["rollout.dynamic_sampling=true", "algorithm.advantage_estimator=gae"])
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling.*collective"):
        load_config(None, ["rollout.dynamic_sampling=true", "train.deepspeed=configs/ds_zero2.json"])
    load_config(None, ["rollout.dynamic_sampling=true", "train.deepspeed=configs/ds_zero2.json",
                       "train.mode=decoupled"])
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        load_config(None, ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=0"])
