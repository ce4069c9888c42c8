"""grpo.algorithm against slow plain-Python references and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import ragged_mask, ref_group_advantages, ref_policy_loss, ref_token_logprobs
from grpo.algorithm import (
    ADVANTAGE_SCALES,
    LOSS_AGGREGATIONS,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)

TOL = 1e-6


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


# ---------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_matches_loop_reference(seed, temperature):
    gen = torch.Generator().manual_seed(seed)
    B, T, V = 3, 6, 11
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (B, T), generator=gen)
    got = token_logprobs(logits, ids, temperature)
    want = torch.tensor(ref_token_logprobs(logits.tolist(), ids.tolist(), temperature), dtype=torch.float64)
    assert got.shape == (B, T - 1)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)  # float32 math inside


def test_token_logprobs_does_not_modify_logits_and_has_gradient():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    before = logits.detach().clone()
    ids = torch.randint(0, 7, (2, 5))
    out = token_logprobs(logits, ids, temperature=0.5)
    out.sum().backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_token_logprobs_uniform_logits_hand_computed():
    # Equal logits over V = 4 tokens: every token has log(1/4) whatever the temperature.
    out = token_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 3]]), temperature=0.3)
    assert torch.allclose(out, torch.full((1, 2), math.log(0.25)))


# ---------------------------------------------------------------- kl_k3


def test_kl_k3_hand_computed_and_nonnegative():
    # ref - logp = log 2: k3 = 2 - log 2 - 1 = 0.306853; equal log-probs -> exactly 0.
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([math.log(2.0), -1.0])
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([1 - math.log(2.0), 0.0]), atol=1e-7)
    x = torch.randn(1000)
    assert (kl_k3(x, torch.randn(1000)) >= 0).all()


# ---------------------------------------------------------------- policy_loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("beta,eps_high", [(0.04, None), (0.0, 0.28), (0.1, 0.28)])
def test_policy_loss_matches_loop_reference(seed, G, loss_type, beta, eps_high):
    gen = torch.Generator().manual_seed(seed)
    P, L = 3, 7
    N = P * G
    logp = -torch.rand(N, L, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.3  # ratios beyond the clip range
    ref = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    mask = ragged_mask(N, L, gen).double()
    loss, stats = policy_loss(
        logp, old, ref if beta > 0 else None, adv, mask, epsilon=0.2, epsilon_high=eps_high, beta=beta,
        loss_type=loss_type, max_completion_length=L,
    )
    want_loss, want_kl, want_clip, want_ratio = ref_policy_loss(
        logp.tolist(), old.tolist(), ref.tolist() if beta > 0 else None, adv.tolist(), mask.tolist(),
        0.2, eps_high if eps_high is not None else 0.2, beta, loss_type, L,
    )
    assert abs(loss.item() - want_loss) < TOL
    assert abs(stats["kl"].item() - want_kl) < TOL
    assert abs(stats["clip_fraction"].item() - want_clip) < TOL
    assert abs(stats["ratio_mean"].item() - want_ratio) < TOL


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
def test_padding_values_never_reach_the_loss(loss_type):
    # Values at padded positions differ between passes (another model's log-prob of a pad token, or 0
    # where a micro-batch skipped the column); far apart, exp() of their difference is inf, and inf * 0
    # is NaN. The loss and its gradient must be those of the clean batch, whatever sits there.
    gen = torch.Generator().manual_seed(0)
    N, L = 4, 6
    logp = (-torch.rand(N, L, generator=gen) * 3).requires_grad_()
    old, ref = logp.detach() + 0.1, logp.detach() - 0.2
    mask = ragged_mask(N, L, gen).float()
    adv = torch.randn(N, generator=gen)
    kwargs = dict(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type=loss_type, max_completion_length=L)
    clean, _ = policy_loss(logp, old, ref, adv, mask, **kwargs)
    (clean_grad,) = torch.autograd.grad(clean, logp)
    pad = mask == 0
    assert pad.any()
    dirty_logp = torch.where(pad, torch.tensor(-200.0), logp)
    loss, stats = policy_loss(dirty_logp, old.masked_fill(pad, 0.0), ref.masked_fill(pad, 150.0), adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    torch.testing.assert_close(loss, clean)
    torch.testing.assert_close(grad, clean_grad)


def test_ratio_one_is_reinforce_with_group_baseline():
    # old == new -> ratio 1, no clipping; beta 0 -> per-token loss is -A. With "grpo" aggregation each
    # sequence contributes -A_i, so loss = -mean(A) = 0 for centred advantages, and the gradient w.r.t.
    # a token log-prob is -A_i / (n_i * N): REINFORCE with the group mean as baseline.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(logp, logp.detach(), None, adv, mask, beta=0.0)
    assert abs(loss.item()) < 1e-7
    loss.backward()
    # row 0: -1 / (2 tokens * 2 seqs) = -0.25 each; row 1: +1 / (1 * 2) = 0.5 on its one real token.
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.0]]))
    assert stats["clip_fraction"].item() == 0.0 and stats["ratio_mean"].item() == 1.0


def test_kl_zero_when_policy_equals_reference():
    logp = torch.randn(4, 5)
    _, stats = policy_loss(logp, logp, logp.clone(), torch.randn(4), torch.ones(4, 5), beta=0.04)
    assert stats["kl"].item() == 0.0


def test_clipped_case_hand_computed():
    # ratio = e^0.5 = 1.6487 > 1 + 0.2 with A = +1: the clipped branch 1.2 * 1 is the smaller one, so the
    # objective is 1.2, the loss -1.2, the gradient 0 (clip stops the push), clip_fraction 1.
    # With A = -1 the unclipped -1.6487 is smaller: no clipping there, the loss is +1.6487.
    logp = torch.tensor([[0.5], [0.5]], requires_grad=True)
    old = torch.zeros(2, 1)
    loss_pos, s_pos = policy_loss(logp[:1], old[:1], None, torch.tensor([1.0]), torch.ones(1, 1), beta=0.0)
    assert abs(loss_pos.item() + 1.2) < 1e-6 and s_pos["clip_fraction"].item() == 1.0
    loss_pos.backward()
    assert logp.grad.abs().sum().item() == 0.0
    loss_neg, s_neg = policy_loss(logp[1:], old[1:], None, torch.tensor([-1.0]), torch.ones(1, 1), beta=0.0)
    assert abs(loss_neg.item() - math.exp(0.5)) < 1e-6 and s_neg["clip_fraction"].item() == 0.0


def test_gradient_flows_only_through_logprobs():
    logp = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    ref = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, requires_grad=True)
    loss, _ = policy_loss(logp, old, ref, adv, torch.ones(2, 3), beta=0.1)
    loss.backward()
    assert logp.grad is not None
    assert old.grad is None and ref.grad is None and adv.grad is None


def test_dapo_uses_the_global_normalizer():
    # Two micro-batches of one global batch: summing their losses with the global token count as the
    # normaliser must equal the bnpo loss of the whole batch.
    gen = torch.Generator().manual_seed(3)
    logp, adv = torch.randn(4, 5, generator=gen), torch.randn(4, generator=gen)
    mask = ragged_mask(4, 5, gen)
    whole, _ = policy_loss(logp, logp, None, adv, mask, beta=0.0, loss_type="bnpo")
    n = mask.sum()
    parts = sum(
        policy_loss(logp[s], logp[s], None, adv[s], mask[s], beta=0.0, loss_type="dapo", normalizer=n)[0]
        for s in (slice(0, 2), slice(2, 4))
    )
    assert abs(whole.item() - parts.item()) < TOL


def test_policy_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta == 0"):
        policy_loss(x, x, None, torch.zeros(2), torch.ones(2, 3), beta=0.04)
    with pytest.raises(ValueError, match=r"known: \['bnpo', 'dapo', 'dr_grpo', 'grpo'\]"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), loss_type="dr_grpo")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, torch.zeros(3), torch.ones(2, 3))
