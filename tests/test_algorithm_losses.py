"""grpo.algorithm's losses: the k3 KL, the clipped policy loss (token-level and GSPO's sequence-level ratios),
the value loss, truncated importance weights and entropy against loop references and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_references import (
    ragged_mask,
    ref_entropy,
    ref_policy_loss,
    ref_truncated_weights,
    ref_value_loss,
)
from grpo.algorithm import (
    LOSS_AGGREGATIONS,
    kl_k3,
    policy_loss,
    token_entropy,
    truncated_importance_weights,
    value_loss,
)

TOL = 1e-6


def loss_inputs(seed: int, N: int, L: int, spread: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, L, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * spread  # ratios beyond the clip
    ref = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    return logp, old, ref, adv, ragged_mask(N, L, gen).double()


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


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_times_ratio_matches_loop_reference_and_trls_gradient(level):
    # TRL's use_bias_correction_kl: ratio * k3 (the ratio keeps its gradient), at the importance-sampling level
    gen = torch.Generator().manual_seed(3)
    N, L = 6, 5
    logp = (-torch.rand(N, L, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    mask = ragged_mask(N, L, gen).double()
    loss, stats = policy_loss(logp, old, ref, adv, mask, beta=0.1, loss_type="dapo", importance_sampling_level=level,
                              kl_times_ratio=True)
    want_loss, want_kl, _, _ = ref_policy_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                                               0.2, 0.2, 0.1, "dapo", L, level=level, kl_times_ratio=True)
    assert abs(loss.item() - want_loss) < TOL and abs(stats["kl"].item() - want_kl) < TOL
    plain, _ = policy_loss(logp, old, ref, adv, mask, beta=0.1, loss_type="dapo", importance_sampling_level=level)
    (grad,) = torch.autograd.grad(loss, logp)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    assert not torch.allclose(grad, plain_grad)  # the ratio's gradient reaches the KL term


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


# ---------------------------------------------------------------- policy_loss(importance_sampling_level="sequence")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("beta,eps_high", [(0.04, None), (0.0, 0.28)])
def test_gspo_matches_loop_reference(seed, G, loss_type, beta, eps_high):
    P, L = 3, 7
    logp, old, ref, adv, mask = loss_inputs(seed, P * G, L, spread=0.6)  # some rows' mean ratio leaves the clip
    loss, stats = policy_loss(logp, old, ref if beta > 0 else None, adv, mask, epsilon=0.2, epsilon_high=eps_high,
                              beta=beta, loss_type=loss_type, max_completion_length=L,
                              importance_sampling_level="sequence")
    want = ref_policy_loss(logp.tolist(), old.tolist(), ref.tolist() if beta > 0 else None, adv.tolist(),
                           mask.tolist(), 0.2, 0.2 if eps_high is None else eps_high, beta, loss_type, L,
                           level="sequence")
    got = (loss.item(), stats["kl"].item(), stats["clip_fraction"].item(), stats["ratio_mean"].item())
    assert all(abs(g - w) < TOL for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_policy_loss_gradient_matches_the_loop_reference(seed, level, loss_type):
    # The loop reference has no autograd: its gradient is taken by central differences (float64, h = 1e-6:
    # error ~1e-10), and autograd's gradient of the vectorised loss must agree. At the sequence level every
    # real token of a row gets d loss / d ratio * ratio / n_real through the mean; padding gets nothing.
    N, L = 4, 5
    logp, old, ref, adv, mask = loss_inputs(seed, N, L, spread=0.1)
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, ref, adv, mask, beta=0.04, loss_type=loss_type, max_completion_length=L,
                          importance_sampling_level=level)
    (grad,) = torch.autograd.grad(loss, logp)

    def reference(values):
        return ref_policy_loss(values, old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 0.04,
                               loss_type, L, level=level)[0]

    h = 1e-6
    numeric = torch.zeros(N, L, dtype=torch.float64)
    base = logp.detach().tolist()
    for i in range(N):
        for t in range(L):
            up = [row[:] for row in base]
            down = [row[:] for row in base]
            up[i][t] += h
            down[i][t] -= h
            numeric[i, t] = (reference(up) - reference(down)) / (2 * h)
    assert torch.allclose(grad, numeric, atol=TOL, rtol=0)
    assert (grad[mask == 0] == 0).all()


def test_gspo_hand_computed():
    # One row, two real tokens and a padded one, A = +1, beta 0. log-ratios (0.1, 0.3): the row's ratio is
    # exp(0.2) = 1.2214 > 1 + 0.2, so the clipped 1.2 is the objective at both tokens (loss -1.2, no gradient,
    # clip_fraction 1); token-level, the first token's exp(0.1) = 1.1052 would have stayed unclipped.
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.3, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask, beta=0.0,
                              importance_sampling_level="sequence")
    assert abs(loss.item() + 1.2) < 1e-12 and stats["clip_fraction"].item() == 1.0
    assert abs(stats["ratio_mean"].item() - math.exp(0.2)) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad == 0).all()
    # Log-ratios (0.1, -0.1): the row's ratio is exp(0) = 1, inside the clip; grpo aggregation gives
    # loss = -ratio * A, and d/dlogp_t = -ratio * A / n_real = -0.5 at each real token (the mean's share).
    logp = torch.tensor([[0.1, -0.1, 5.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask, beta=0.0,
                          importance_sampling_level="sequence")
    assert abs(loss.item() + 1.0) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.tensor([[-0.5, -0.5, 0.0]], dtype=torch.float64), atol=1e-12)


def test_sequence_level_equals_token_level_for_one_token_rows():
    logp, old, ref, adv, _ = loss_inputs(4, 6, 1)
    mask = torch.ones(6, 1, dtype=torch.float64)
    token, _ = policy_loss(logp, old, ref, adv, mask)
    sequence, _ = policy_loss(logp, old, ref, adv, mask, importance_sampling_level="sequence")
    assert abs(token.item() - sequence.item()) < 1e-12


def test_unknown_importance_sampling_level_lists_the_known():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown importance_sampling_level 'seq'; known: \['sequence', 'token'\]"):
        policy_loss(x, x, None, torch.zeros(2), torch.ones(2, 3), beta=0.0, importance_sampling_level="seq")


# ---------------------------------------------------------------- value_loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [0.05, 0.2, 10.0])
def test_value_loss_matches_loop_reference(seed, clip):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(6, 8, gen).double()
    values, old, returns = (torch.randn(6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    values = values.masked_fill(mask == 0, math.inf).requires_grad_(True)  # padding's garbage never counts
    loss, stats = value_loss(values, old, returns, mask, clip)
    want_loss, want_clip = ref_value_loss(values.tolist(), old.tolist(), returns.tolist(), mask.tolist(), clip)
    assert abs(loss.item() - want_loss) < TOL and abs(stats["value_clip_fraction"].item() - want_clip) < TOL
    (grad,) = torch.autograd.grad(loss, values)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_value_loss_hand_computed():
    # V_old 0, clip 0.2, return 1. V = 0.5 moved past the clip: clipped V is 0.2, whose error (0.8^2 = 0.64)
    # is larger than the unclipped 0.25, so the loss is 0.5 * 0.64 = 0.32 and V gets no gradient.
    # V = 1.1 overshot the return: clipped 0.2 gives 0.64 again against 0.01: 0.32 as well. V = 0.1 inside
    # the clip: both branches 0.81, loss 0.405, gradient (V - R) / n = -0.9 / 3 from the masked mean.
    values = torch.tensor([[0.5, 1.1, 0.1]], dtype=torch.float64, requires_grad=True)
    zeros, returns = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, stats = value_loss(values, zeros, returns, torch.ones(1, 3), clip_range=0.2)
    assert abs(loss.item() - (0.32 + 0.32 + 0.405) / 3) < 1e-12
    assert abs(stats["value_clip_fraction"].item() - 2 / 3) < 1e-12
    (grad,) = torch.autograd.grad(loss, values)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, -0.3]], dtype=torch.float64), atol=1e-12)


def test_value_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(x, x, x, torch.ones(2, 3), 0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        value_loss(x, x, torch.zeros(3, 2), torch.ones(2, 3), 0.2)


# ---------------------------------------------------------------- truncated_importance_weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [1.0, 2.0, 1e9])
def test_truncated_weights_match_loop_reference(seed, cap):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(5, 6, gen).double()
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    sampler = (old + torch.randn(5, 6, generator=gen, dtype=torch.float64)).masked_fill(mask == 0, -1e4)
    got = truncated_importance_weights(old, sampler, mask, cap)
    want = ref_truncated_weights(old.tolist(), sampler.tolist(), mask.tolist(), cap)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0)


def test_truncated_weights_hand_computed():
    # The trainer gives the token log 0.5, the sampler log 0.25: it was under-sampled, weight 0.5 / 0.25 = 2,
    # capped at C = 1.5. The reverse, 0.25 / 0.5 = 0.5, stays (only large weights are truncated). Padding: 0.
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 1e-30]], dtype=torch.float64))
    got = truncated_importance_weights(old, sampler, torch.tensor([[1, 1, 0]]), cap=1.5)
    assert torch.allclose(got, torch.tensor([[1.5, 0.5, 0.0]], dtype=torch.float64), atol=1e-12)


# ---------------------------------------------------------------- token_entropy


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_entropy_matches_loop_reference(seed, temperature, chunk):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 11, generator=gen, dtype=torch.float64) * 3
    got = token_entropy(logits, temperature, chunk_tokens=chunk)
    want = torch.tensor(ref_entropy(logits.tolist(), temperature), dtype=torch.float64)
    assert got.shape == (3, 5) and got.dtype == torch.float64
    assert torch.allclose(got, want, atol=TOL, rtol=0)


def test_entropy_hand_computed():
    # Uniform over V = 4: log 4 = 1.386294 at any temperature. One logit at -inf and three equal: log 3, not
    # NaN. A near one-hot row (a logit 100 above the rest): ~0. float32 logits give float32, bf16 too.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [-math.inf, 1.0, 1.0, 1.0], [100.0, 0.0, 0.0, 0.0], [0.0] * 4]])
    got = token_entropy(logits, temperature=0.5)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor([[math.log(4), math.log(3), 0.0]]), atol=1e-6)
    assert token_entropy(logits.to(torch.bfloat16)).dtype == torch.float32


def test_entropy_has_no_graph_and_leaves_logits_alone():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    before = logits.detach().clone()
    out = token_entropy(logits, 0.8)
    assert not out.requires_grad and torch.equal(logits.detach(), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_entropy_on_cuda_matches_the_cpu_for_bf16_logits():
    # The training forward's logits are bf16 on a GPU; chunks cross row boundaries (33 positions, 16 a chunk).
    logits = (torch.randn(4, 33, 1000, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    on_cpu = token_entropy(logits, 0.7)
    on_gpu = token_entropy(logits.cuda(), 0.7, chunk_tokens=16).cpu()
    assert torch.allclose(on_gpu, on_cpu, atol=1e-5, rtol=0)
