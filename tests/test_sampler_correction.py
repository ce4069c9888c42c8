"""The truncated importance-sampling correction for a sampler that is not the trainer
(loss.sampler_is_correction): the weights of every mode against a loop reference and by hand, their
place in the loss, their wiring in the update (a stale sampler's log-probs on the batch), the decoupled
sampler's hand-over, and the config rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from algorithm_references import ragged_mask, ref_sampler_weights
from step_helpers import RecordingLearner, random_batch

from grpo.algorithm import SAMPLER_CORRECTIONS, policy_loss, sampler_importance_weights
from grpo.config import ConfigError, load_config
from grpo.models.tiny import build_qwen2
from grpo.step.experience import generation_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.parallel.distributed import DistInfo

TOL = 1e-9


@pytest.mark.parametrize("mode", sorted(SAMPLER_CORRECTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap, floor", [(1.0, None), (2.0, None), (1e9, None), (2.0, 0.8), (1.0, 0.0)])
def test_weights_match_the_loop_reference(mode, seed, cap, floor):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(5, 6, gen).double()
    old = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    sampler = (old + torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.4).masked_fill(mask == 0, -1e4)
    weights, over = sampler_importance_weights(old, sampler, mask, cap, mode, floor)
    want_weights, want_over = ref_sampler_weights(old.tolist(), sampler.tolist(), mask.tolist(), cap, mode, floor)
    assert torch.allclose(weights, torch.tensor(want_weights, dtype=torch.float64), atol=TOL, rtol=1e-12)
    assert over.tolist() == want_over


def test_weights_by_hand():
    # Trainer probabilities 0.5, 0.25 (and a padded 0.9); sampler 0.25, 0.5: token ratios 2 and 0.5.
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 1e-30]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0]])
    cases = {
        "token_truncate": ([1.5, 0.5, 0.0], [True, False, False]),  # 2 capped at C = 1.5
        "token_mask": ([0.0, 0.5, 0.0], [True, False, False]),  # 2 > C: that token drops out
        # the sequence ratio is 2 * 0.5 = 1 (padding excluded), under the cap: every real token gets 1
        "sequence_truncate": ([1.0, 1.0, 0.0], [False, False, False]),
        "sequence_mask": ([1.0, 1.0, 0.0], [False, False, False]),
    }
    for mode, (weights, over) in cases.items():
        got, got_over = sampler_importance_weights(old, sampler, mask, 1.5, mode)
        assert torch.allclose(got, torch.tensor([weights], dtype=torch.float64), atol=1e-12), mode
        assert got_over.tolist() == [over], mode
    # A sequence ratio of 0.5 * 0.5 / (0.25 * 0.25) = 4 > C = 3: truncated to 3 on both tokens, or masked.
    old2, sampler2 = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.25]]))
    got, over = sampler_importance_weights(old2, sampler2, torch.ones(1, 2), 3.0, "sequence_truncate")
    assert torch.allclose(got, torch.tensor([[3.0, 3.0]])) and over.all()
    got, _ = sampler_importance_weights(old2, sampler2, torch.ones(1, 2), 3.0, "sequence_mask")
    assert torch.equal(got, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"unknown sampler correction mode 'token'; known: \['sequence_mask'"):
        sampler_importance_weights(old, sampler, mask, 1.5, "token")


def test_the_lower_bound_by_hand():
    # token ratios 2 and 0.5 (as above) with the bounds [0.8, 3]: 0.5 is raised to 0.8, or masked
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 1e-30]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0]])
    got, outside = sampler_importance_weights(old, sampler, mask, 3.0, "token_truncate", floor=0.8)
    assert torch.allclose(got, torch.tensor([[2.0, 0.8, 0.0]], dtype=torch.float64))
    assert outside.tolist() == [[False, True, False]]
    got, outside = sampler_importance_weights(old, sampler, mask, 3.0, "token_mask", floor=0.8)
    assert torch.allclose(got, torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64))
    assert outside.tolist() == [[False, True, False]]
    # the sequence ratio 2 * 0.5 = 1 is inside [0.8, 3]; with a floor of 1.5 it is not
    got, _ = sampler_importance_weights(old, sampler, mask, 3.0, "sequence_truncate", floor=1.5)
    assert torch.allclose(got, torch.tensor([[1.5, 1.5, 0.0]], dtype=torch.float64))
    got, _ = sampler_importance_weights(old, sampler, mask, 3.0, "sequence_mask", floor=1.5)
    assert torch.equal(got, torch.zeros(1, 3, dtype=torch.float64))
    for floor in (-0.1, 3.0):
        with pytest.raises(ValueError, match=r"floor must be in \[0, cap=3.0\)"):
            sampler_importance_weights(old, sampler, mask, 3.0, "token_truncate", floor=floor)


def test_the_weights_scale_the_surrogate_not_the_kl():
    # On-policy (logp = old: ratio 1, nothing clipped) each token's surrogate is A; with weights w the bnpo
    # loss is -sum(w * A) / tokens + beta * mean(k3), and d loss / d logp_t = -w_t * A / tokens + beta * dk3.
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    ref = torch.tensor([[0.3, -0.2], [0.1, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.5], [1.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    beta = 0.1
    loss, _ = policy_loss(logp, old, ref, adv, mask, beta=beta, loss_type="bnpo", sampler_weights=weights)
    k3 = torch.exp(ref) - ref - 1  # at logp = 0
    surrogate = -(2 * 1 + 0.5 * 1 + 1 * -2 + 3 * -2) / 4  # = 1.375
    assert loss.item() == pytest.approx(surrogate + beta * k3.mean().item(), abs=1e-12)
    loss.backward()
    dk3 = 1 - torch.exp(ref)  # d/dlogp of exp(ref - logp) - (ref - logp) - 1 at logp = 0
    want = -weights * adv[:, None] / 4 + beta * dk3 / 4
    assert torch.allclose(logp.grad, want, atol=1e-12)


def settings(**extra) -> LossSettings:
    values = dict(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type="grpo", max_completion_length=7,
                  temperature=0.9, num_iterations=1, micro_batch_size=2, max_grad_norm=None)
    values.update(extra)
    return LossSettings(**values)


def capture_policy_loss(monkeypatch) -> list[dict]:
    """Records the old log-probs and sampler weights train_on_batch hands policy_loss, per micro-batch."""
    import grpo.step.micro_batch_loss as optimization

    real, calls = optimization.policy_loss, []

    def recording(logprobs, old, ref, advantages, mask, **kwargs):
        calls.append({"old": old.detach().clone(), "weights": kwargs["sampler_weights"]})
        return real(logprobs, old, ref, advantages, mask, **kwargs)

    monkeypatch.setattr(optimization, "policy_loss", recording)
    return calls


@pytest.mark.parametrize("floor", [None, 0.6])
def test_a_stale_samplers_logprobs_weight_each_token_by_the_capped_ratio(tiny_tokenizer, monkeypatch, floor):
    # Colocated vLLM with num_iterations 1: no old log-probs on the batch, so pi_old is the update's own
    # first forward pass (detached); the sampler's differ by +-0.7 or +2 nats per token.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    batch.old_logprobs = None
    gen = batch.generation
    trainer = generation_logprobs(model, gen, 0.9, 64)  # [N, Lc]
    drift = torch.tensor([0.7, -0.7, 2.0, 0.0, -0.7, 0.7, 0.0])[None].expand_as(trainer)
    batch.sampler_logprobs = ((trainer - drift) * gen.completion_mask).detach()
    cap = 1.5
    calls = capture_policy_loss(monkeypatch)
    stats = train_on_batch(RecordingLearner(model), batch, settings(sampler_is_mode="token_truncate",
                                                                    sampler_is_cap=cap, sampler_is_min=floor),
                           DistInfo()).totals
    from grpo.step.micro_batches import rows_by_length

    order = rows_by_length(gen.completion_mask, 2)
    got = torch.cat([c["weights"] for c in calls])[torch.argsort(order)]  # back in row order
    real = gen.completion_mask.bool()
    # By hand: weight = min(exp(old - sampler), C) = min(exp(drift), 1.5): e^0.7 = 2.01 -> 1.5 (capped),
    # e^-0.7 = 0.497 (raised to 0.6 with loss.sampler_is_min 0.6), e^2 -> 1.5, e^0 = 1; 0 on padding.
    hand = drift.exp().clamp(min=floor, max=cap) * real
    assert torch.allclose(got, hand, atol=1e-5)
    capped = ((drift > math.log(cap)) | (floor is not None and drift < math.log(floor or 1))) & real
    assert stats["sampler_is/capped_fraction"] == pytest.approx(float(capped.sum() / real.sum()), abs=1e-6)
    assert stats["sampler_is/weight_mean"] == pytest.approx(float(hand.sum() / real.sum()), abs=1e-5)
    assert stats["sampler_is/logprob_diff"] == pytest.approx(float((drift.abs() * real).sum() / real.sum()), abs=1e-5)


def test_identical_logprobs_leave_the_update_unchanged(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    batch.old_logprobs = None
    batch.sampler_logprobs = generation_logprobs(model, batch.generation, 0.9, 64) * batch.generation.completion_mask
    plain, corrected = RecordingLearner(model), RecordingLearner(model)
    off = train_on_batch(plain, batch, settings(), DistInfo()).totals
    on = train_on_batch(corrected, batch, settings(sampler_is_mode="token_truncate"), DistInfo()).totals
    assert "sampler_is/weight_mean" not in off
    assert on["sampler_is/weight_mean"] == pytest.approx(1.0, abs=1e-5) and on["sampler_is/capped_fraction"] == 0.0
    assert on["loss"] == pytest.approx(off["loss"], abs=1e-6)
    for name, grad in plain.grads[0].items():
        assert torch.allclose(corrected.grads[0][name], grad, atol=1e-6, rtol=1e-5), name


def test_with_old_logprobs_on_the_batch_they_are_pi_old(tiny_tokenizer, monkeypatch):
    # Colocated vLLM with num_iterations 2 (or a decoupled batch): the batch's old log-probs are pi_old,
    # and the weights stay the same in both iterations.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    batch.sampler_logprobs = batch.old_logprobs - 0.25
    calls = capture_policy_loss(monkeypatch)
    train_on_batch(RecordingLearner(model), batch, settings(num_iterations=2, micro_batch_size=6,
                                                            sampler_is_mode="token_truncate"), DistInfo()).totals
    real = batch.generation.completion_mask
    assert len(calls) == 2
    for call in calls:
        assert torch.allclose(call["weights"], math.exp(0.25) * real, atol=1e-6)


def test_the_correction_without_sampler_logprobs_is_an_error(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    with pytest.raises(ValueError, match="no sampler log-probs"):
        train_on_batch(RecordingLearner(model), random_batch(len(tiny_tokenizer)),
                       settings(sampler_is_mode="token_truncate"), DistInfo()).totals


def test_the_decoupled_sampler_hands_over_its_own_logprobs():
    from grpo.decoupled.sampler_role import for_correction

    batch = random_batch(100)
    old = batch.old_logprobs
    off = for_correction(batch, correction=False)
    assert off.old_logprobs is old and off.sampler_logprobs is None
    on = for_correction(batch, correction=True)  # an HF sampler: its old log-probs, at its own weights
    assert on.old_logprobs is None and on.sampler_logprobs is old
    batch.sampler_logprobs = old - 1  # a vLLM sampler reports its own
    assert torch.equal(for_correction(batch, correction=True).sampler_logprobs, old - 1)


def test_the_correction_is_refused_where_the_trainer_samples():
    with pytest.raises(ConfigError, match=r"loss.sampler_is_correction.*every weight would be exactly 1"):
        load_config(None, ["loss.sampler_is_correction=true"])
    load_config(None, ["loss.sampler_is_correction=true", "rollout.engine=vllm", "rollout.vllm_check_steps=0"])
    load_config(None, ["loss.sampler_is_correction=true", "train.mode=decoupled"])
    with pytest.raises(ConfigError, match="sampler_is_mode"):
        load_config(None, ["loss.sampler_is_mode=token"])
    with pytest.raises(ConfigError, match=r"loss.sampler_is_min.*3.0 must be below loss.sampler_is_cap \(3.0\)"):
        load_config(None, ["loss.sampler_is_correction=true", "train.mode=decoupled", "loss.sampler_is_min=3.0"])


@pytest.mark.slow
@pytest.mark.parametrize("drift, cap, weight, capped", [(0.05, 3.0, math.exp(-0.05), 0.0),
                                                        (-0.05, 1.02, 1.02, 1.0)])
def test_a_vllm_like_engine_with_dynamic_sampling_gets_its_tokens_weighted(monkeypatch, tiny_model_dir, tmp_path,
                                                                           drift, cap, weight, capped):
    # A fake vLLM engine (the policy's own log-probs + drift, step_helpers.DriftingEngine) under `grpo train`,
    # with dynamic sampling, so the sampler log-probs of several rounds are merged with their groups: every
    # real token's weight is min(exp(-drift), C) only if each row kept its own log-probs.
    from step_helpers import logged, run_train

    import grpo.training.colocated

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "integration"))
    monkeypatch.setattr(grpo.training.colocated, "check_engine_available", lambda cfg: None)
    box = {"kwargs": {"drift": drift}}
    out = tmp_path / "run"
    assert run_train(monkeypatch, tiny_model_dir, out, box, "train.max_steps=2", "rollout.engine=vllm",
                     "loss.sampler_is_correction=true", f"loss.sampler_is_cap={cap}", "rollout.vllm_check_steps=1",
                     "rollout.dynamic_sampling=true", "rewards=[{name: 'rewards_for_tests:letters_on_even_answers'}]",
                     "train.prompts_per_step=4") == 0
    rows = [r for r in logged(out) if "loss" in r]
    assert any(r["rollout/dynamic_rounds"] > 1 for r in rows)
    for row in rows:
        assert row["sampler_is/weight_mean"] == pytest.approx(weight, abs=1e-5)
        assert row["sampler_is/capped_fraction"] == pytest.approx(capped, abs=1e-6)
        assert row["sampler_is/logprob_diff"] == pytest.approx(abs(drift), abs=1e-5)
        assert row["rollout/logprob_diff"] == pytest.approx(abs(drift), abs=1e-5)  # the guard saw every round too
