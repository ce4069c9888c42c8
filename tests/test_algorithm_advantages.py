"""grpo.algorithm's advantage estimators, GAE, whitening and KL-in-reward against loop references and
hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import (
    ragged_mask,
    ref_gae,
    ref_group_advantages,
    ref_kl_token_rewards,
    ref_reinforce_pp,
    ref_rloo,
    ref_whiten,
)
from grpo.algorithm import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    gae_advantages,
    group_advantages,
    kl_penalized_token_rewards,
    whiten,
)

TOL = 1e-6


def discrete_rewards(P: int, G: int, seed: int) -> torch.Tensor:
    # As real reward functions give: equal groups happen (the first is forced) and must give exactly 0.
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(-2, 3, (P * G,), generator=gen).double() * 0.75
    rewards[:G] = 1.0
    return rewards


# ---------------------------------------------------------------- group_advantages(estimator=...)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("estimator", sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.group_baseline))
def test_estimators_match_loop_references(seed, G, estimator):
    rewards = discrete_rewards(5, G, seed)
    want = {"grpo": lambda r: ref_group_advantages(r, G, "group", 1e-4),
            "rloo": lambda r: ref_rloo(r, G),
            "reinforce_pp": lambda r: ref_reinforce_pp(r, G, 1e-4)}[estimator](rewards.tolist())
    got = group_advantages(rewards, G, eps=1e-4, estimator=estimator)
    assert got.shape == rewards.shape
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=TOL, rtol=0)
    assert (got[:G] == 0).all()  # the all-equal group, exactly


def test_grpo_estimator_is_todays_default():
    rewards = discrete_rewards(4, 4, 7)
    for scale in (None, "group"):
        assert torch.equal(group_advantages(rewards, 4, scale=scale, estimator="grpo"), group_advantages(rewards, 4))


def test_rloo_hand_computed():
    # G = 2: each completion's reward minus the other's: [3, 1] -> [3 - 1, 1 - 3] = [2, -2].
    assert group_advantages(torch.tensor([3.0, 1.0]), 2, estimator="rloo").tolist() == [2.0, -2.0]
    # G = 3, [1, 0, 0]: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 for each of the other two.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, estimator="rloo")
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5]), atol=1e-7, rtol=0)
    # G = 1: no other completion, no baseline, no signal.
    assert group_advantages(torch.tensor([5.0, -2.0]), 1, estimator="rloo").tolist() == [0.0, 0.0]


def test_reinforce_pp_hand_computed():
    # Groups [1, 0] and [2, 2]: centred [0.5, -0.5, 0, 0]; their batch mean is 0 and Bessel variance
    # (0.25 + 0.25) / 3 = 1/6, so the std is 0.408248 and 0.5 / 0.408248 = 1.224745 (eps 0).
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, eps=0.0, estimator="reinforce_pp")
    assert torch.allclose(adv, torch.tensor([1.2247449, -1.2247449, 0.0, 0.0]), atol=1e-6, rtol=0)
    # Unlike grpo's scale "batch", the spread between groups (rewards 0.5 vs 2 on average) does not count:
    # with the raw rewards' std (0.957427) the first advantage would be 0.5222.
    batch = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, scale="batch", eps=0.0)
    assert abs(batch[0].item() - 0.5 / 0.9574271) < 1e-6


def test_estimator_errors():
    known = r"known: \['gae', 'grpo', 'reinforce_pp', 'rloo'\]"
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; " + known):
        group_advantages(torch.zeros(4), 2, estimator="ppo")
    with pytest.raises(ValueError, match=r"'gae' works per token from a critic's values"):
        group_advantages(torch.zeros(4), 2, estimator="gae")
    with pytest.raises(ValueError, match=r"'rloo' has its own scaling; scale 'group' applies to the 'grpo'"):
        group_advantages(torch.zeros(4), 2, scale="group", estimator="rloo")
    with pytest.raises(ValueError, match=r"known: \['batch', 'group', 'none'\]"):
        group_advantages(torch.zeros(4), 2, scale="loo", estimator="reinforce_pp")


# ---------------------------------------------------------------- gae_advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_loop_reference(seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    N, L = 6, 9
    mask = ragged_mask(N, L, gen).double()
    rewards = torch.randn(N, L, generator=gen, dtype=torch.float64)
    values = torch.randn(N, L, generator=gen, dtype=torch.float64)
    # Padding holds garbage (another pass's values): it must not reach the real tokens.
    rewards, values = rewards.masked_fill(mask == 0, 1e6), values.masked_fill(mask == 0, -1e6)
    advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
    want_adv, want_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    assert torch.allclose(advantages, torch.tensor(want_adv, dtype=torch.float64), atol=TOL, rtol=0)
    assert torch.allclose(returns, torch.tensor(want_ret, dtype=torch.float64), atol=TOL, rtol=0)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gae_hand_computed():
    # One row, rewards [0, 0, 1], values [0.5, 0.2, 0.1], gamma 0.9, and a padded 4th position.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.1, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    # lam = 1: A_t is the discounted return from t minus V_t: returns (0.81, 0.9, 1), so A = (0.31, 0.7, 0.9)
    # and the GAE returns are the discounted returns themselves.
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.31, 0.7, 0.9, 0.0]], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ret, torch.tensor([[0.81, 0.9, 1.0, 0.0]], dtype=torch.float64), atol=1e-12)
    # lam = 0: one-step TD errors r_t + 0.9 V_{t+1} - V_t = (0.18 - 0.5, 0.09 - 0.2, 1 - 0.1); the last
    # token's V_{t+1} is 0 (the episode ends), not the padding's 3.0.
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.0)
    assert torch.allclose(adv, torch.tensor([[-0.32, -0.11, 0.9, 0.0]], dtype=torch.float64), atol=1e-12)


def test_gae_rejects_a_mask_with_gaps():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="prefix"):
        gae_advantages(x, x, torch.tensor([[1.0, 0.0, 1.0]]), 1.0, 1.0)


# ---------------------------------------------------------------- whiten


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whiten_matches_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(5, 7, gen).double()
    x = (torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3 + 2).masked_fill(mask == 0, 1e9)
    got = whiten(x, mask)
    assert torch.allclose(got, torch.tensor(ref_whiten(x.tolist(), mask.tolist(), 1e-8), dtype=torch.float64),
                          atol=TOL, rtol=0)
    real = got[mask == 1]
    assert abs(real.mean().item()) < 1e-12 and abs(real.std().item() - 1) < 1e-6


def test_whiten_hand_computed():
    # [1, 2, 3] (and a padded 100): mean 2, Bessel variance ((-1)^2 + 0 + 1^2) / 2 = 1 -> [-1, 0, 1].
    got = whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64), torch.tensor([[1, 1, 1, 0]]))
    assert torch.allclose(got, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64), atol=1e-7)
    # A constant input whitens to 0 (eps keeps it finite).
    assert (whiten(torch.full((2, 3), 4.0), torch.ones(2, 3)) == 0).all()


# ---------------------------------------------------------------- kl_penalized_token_rewards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_token_rewards_match_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(6, 8, gen).double()
    kl = torch.rand(6, 8, generator=gen, dtype=torch.float64).masked_fill(mask == 0, math.inf)
    rewards = torch.randn(6, generator=gen, dtype=torch.float64)
    got = kl_penalized_token_rewards(rewards, kl, mask, kl_coef=0.05)
    want = ref_kl_token_rewards(rewards.tolist(), kl.tolist(), mask.tolist(), 0.05)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0)


def test_kl_token_rewards_hand_computed():
    # kl (0.1, 0.2) on two real tokens, coefficient 0.5 -> (-0.05, -0.1); the sequence reward 1 lands on
    # the last real token: (-0.05, 0.9), padding 0. With lam = gamma = 1 GAE then sums them: A_0 + V_0 = 0.85.
    kl = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    rewards = kl_penalized_token_rewards(torch.tensor([1.0], dtype=torch.float64), kl, mask, kl_coef=0.5)
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.9, 0.0]], dtype=torch.float64), atol=1e-12)
    _, returns = gae_advantages(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    assert abs(returns[0, 0].item() - 0.85) < 1e-12


def test_kl_token_rewards_errors():
    with pytest.raises(ValueError, match="no real token"):
        kl_penalized_token_rewards(torch.zeros(2), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match=r"sequence_rewards must be \[N\]=2"):
        kl_penalized_token_rewards(torch.zeros(3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)


# ---------------------------------------------------------------- group_advantages



@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALES))
def test_group_advantages_matches_loop_reference(seed, G, scale):
    gen = torch.Generator().manual_seed(seed)
    P = 5
    # Discrete rewards as real reward functions give: equal groups happen and must give 0.
    rewards = torch.randint(-2, 3, (P * G,), generator=gen).double() * 0.75
    rewards[:G] = 1.0  # one group with no signal
    got = group_advantages(rewards, G, scale=scale, eps=1e-4)
    want = ref_group_advantages(rewards.tolist(), G, scale, 1e-4)
    assert got.shape == (P * G,)
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=TOL, rtol=0)
    assert (got[:G] == 0).all()


def test_group_advantages_hand_computed():
    # Group [1, 0, 0, 1]: mean 0.5, Bessel std = sqrt(4 * 0.25 / 3) = 0.57735; eps 0 -> +-0.866025.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254]), atol=1e-6)
    # "none" only centres: [3, 1] -> [1, -1]; "batch" with one group equals "group".
    assert group_advantages(torch.tensor([3.0, 1.0]), 2, scale="none").tolist() == [1.0, -1.0]


def test_group_advantages_all_equal_groups_are_exact_zero():
    # 0.1 repeated: its float mean may differ by an ulp; advantages must still be exactly 0.
    rewards = torch.tensor([0.1] * 3 + [0.7] * 3, dtype=torch.float32)
    for scale in ADVANTAGE_SCALES:
        assert (group_advantages(rewards, 3, scale=scale) == 0).all()
    assert (group_advantages(torch.tensor([2.0, -1.0, 5.0]), 1) == 0).all()  # G = 1


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="not a multiple"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=r"known: \['batch', 'group', 'none'\]"):
        group_advantages(torch.zeros(4), 2, scale="rloo")
