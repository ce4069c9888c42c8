"""TRL's loss types, masks and entropy bonus reach the update (``grpo.step.policy_update``) from the config: the
accumulated gradient of a step equals ``policy_loss`` (with the masks it should get) and the entropy bonus taken on
the whole batch at once, for every loss type, with the micro-batches split any way; the entropy with gradient
(``token_entropy_with_grad``, the fused head's) is the entropy and has its gradient. The math of each variant is
checked against TRL itself in tests/test_algorithm_trl_parity.py."""

from __future__ import annotations

import pytest
import torch
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.algorithm import (
    entropy_bonus,
    high_entropy_mask,
    off_policy_mask,
    policy_loss,
    token_entropy,
    token_entropy_with_grad,
)
from grpo.algorithm.head import head_logprobs
from grpo.config import load_config
from grpo.models.tiny import build_qwen2
from grpo.parallel.distributed import DistInfo
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.training.settings import loss_settings


def _naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    return -(p * torch.log_softmax(logits, -1)).sum(-1)


def test_the_entropy_with_gradient_is_the_entropy_and_has_its_gradient():
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11, dtype=torch.float64) * 3).requires_grad_()
    with_grad = token_entropy_with_grad(logits, temperature=0.7, chunk_tokens=4)  # chunks cut rows
    assert torch.allclose(with_grad, token_entropy(logits.detach(), 0.7), atol=1e-12)
    weights = torch.randn(3, 4, dtype=torch.float64)
    (grad,) = torch.autograd.grad((with_grad * weights).sum(), logits)
    naive = logits.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((_naive_entropy(naive[:, :-1] / 0.7) * weights).sum(), naive)
    assert torch.allclose(grad, want, atol=1e-12)
    # the fused head: the same entropy and gradient from the hidden states, log-probs unchanged
    hidden = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(4, 9, bias=False).double()
    targets = torch.randint(0, 9, (2, 6))
    logprobs, entropy = head_logprobs(hidden, head, targets, 0.8, vocab_size=9, entropy_grad=True, chunk_columns=4)
    plain, _ = head_logprobs(hidden, head, targets, 0.8, vocab_size=9)
    assert torch.allclose(logprobs, plain, atol=1e-12)
    scores = head(hidden) / 0.8
    assert torch.allclose(entropy, _naive_entropy(scores), atol=1e-12)
    (grad,) = torch.autograd.grad(entropy.sum(), hidden, retain_graph=True)
    (want,) = torch.autograd.grad(_naive_entropy(head(hidden) / 0.8).sum(), hidden)
    assert torch.allclose(grad, want, atol=1e-12)


VARIANTS = {  # config overrides -> the run's loss settings
    "cispo": ["loss.loss_type=cispo", "loss.epsilon_high=1.3"],
    "sapo": ["loss.loss_type=sapo", "loss.sapo_temperature_neg=2.0"],
    "vespo": ["loss.loss_type=vespo"],
    "luspo": ["loss.loss_type=luspo", "loss.importance_sampling_level=sequence"],
    "delta": ["loss.loss_type=bnpo", "loss.delta=1.25"],
    "top entropy": ["loss.loss_type=dapo", "loss.top_entropy_quantile=0.5"],
    "off-policy mask": ["loss.loss_type=grpo", "loss.off_policy_mask_threshold=0.05"],
    "entropy bonus": ["loss.loss_type=grpo", "loss.entropy_coef=0.3"],
    "all": ["loss.loss_type=dr_grpo", "loss.delta=1.3", "loss.top_entropy_quantile=0.4",
            "loss.off_policy_mask_threshold=0.05", "loss.entropy_coef=0.2", "loss.beta=0.04"],
}


def _expected_gradient(model, batch, settings, parts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The gradient of the variant's loss on the whole batch, built here from the pure functions, with the update's
    micro-batches ``parts``: each one's own entropy quantile and entropy bonus (a token mean, weighted by its
    rows), the off-policy mask against the old log-probs."""
    gen = batch.generation
    mask = gen.completion_mask.double()
    model.zero_grad()
    logprobs, entropy = completion_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                            gen.completion_mask, 0.9, with_entropy=True, entropy_grad=True,
                                            share_prompts=False)
    keep = torch.ones_like(mask)
    if settings.top_entropy_quantile < 1:
        for rows in parts:
            keep[rows] = high_entropy_mask(entropy[rows], mask[rows], settings.top_entropy_quantile).double()
    token_mask = keep.clone()
    if settings.off_policy_mask_threshold is not None:
        token_mask = token_mask * off_policy_mask(batch.advantages, logprobs, batch.old_logprobs, mask,
                                                  settings.off_policy_mask_threshold).double()
    loss, _ = policy_loss(logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages, mask,
                          epsilon=settings.epsilon, epsilon_high=settings.epsilon_high, beta=settings.beta,
                          loss_type=settings.loss_type, max_completion_length=7, normalizer=mask.sum(),
                          importance_sampling_level=settings.importance_sampling_level, loss_token_mask=token_mask,
                          kl_times_ratio=settings.kl_times_ratio, **settings.objective)
    if settings.entropy_coef:
        loss = loss - settings.entropy_coef * sum(entropy_bonus(entropy[rows], (mask * keep)[rows]) * len(rows) / 6
                                                  for rows in parts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _near_policy(batch, model):
    """``batch`` with old and reference log-probs near ``model``'s own (float64): ratios around 1, so clips, caps and
    masks decide something, and rows whose sampler was further off (a mean log-ratio above 0.05) for the
    off-policy mask."""
    from dataclasses import replace

    gen = batch.generation
    with torch.no_grad():
        own = completion_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask,
                                  0.9, share_prompts=False)
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(5), dtype=own.dtype)
    offset = torch.tensor([0.0, 0.3, 0.02, -0.2, 0.4, 0.0], dtype=own.dtype)[:, None]  # per row
    return replace(batch, old_logprobs=own + offset + 0.2 * noise, ref_logprobs=own - 0.1 * noise)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_update_of_each_variant_is_policy_loss_on_the_whole_batch(variant, tiny_tokenizer):
    """One update's gradient, in one micro-batch and in three of two rows, equals the gradient of the variant's loss
    on all six rows built from the pure functions (``_expected_gradient``) for the same micro-batches."""
    from grpo.step.micro_batches import rows_by_length

    cfg = load_config(None, ["rollout.temperature=0.9", "rollout.max_completion_length=7", *VARIANTS[variant]])
    settings = loss_settings(cfg, None, "cpu")
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).double()
    batch = _near_policy(random_batch(len(tiny_tokenizer), seed=3), model)
    order = rows_by_length(batch.generation.completion_mask, 2).tolist()  # the update's micro-batches: by length
    for micro, parts in ((6, [list(range(6))]), (2, [order[i:i + 2] for i in range(0, 6, 2)])):
        learner = RecordingLearner(model)
        train_on_batch(learner, batch, settings_with(**{**settings.__dict__, "micro_batch_size": micro,
                                                        "max_tokens_per_micro_batch": None}), DistInfo())
        (got,) = learner.grads
        want = _expected_gradient(model, batch, settings, parts)
        assert want.keys() == got.keys()
        for name, g in want.items():
            # float64 passes; the update's token counts and shares are float32 (its masks'): ~1e-7 relative
            assert torch.allclose(got[name], g, atol=1e-8, rtol=1e-6), (variant, micro, name)


def test_each_setting_changes_the_update(tiny_tokenizer):
    """Not inert: each key, set away from its default, moves the gradient of the same batch."""
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).double()
    batch = _near_policy(random_batch(len(tiny_tokenizer), seed=3), model)

    def gradient(*overrides):
        cfg = load_config(None, ["rollout.temperature=0.9", "rollout.max_completion_length=7", *overrides])
        learner = RecordingLearner(model)
        train_on_batch(learner, batch, loss_settings(cfg, None, "cpu"), DistInfo())
        return torch.cat([g.flatten() for g in learner.grads[0].values()])

    base = gradient()
    for overrides in VARIANTS.values():
        assert not torch.allclose(gradient(*overrides), base, atol=1e-4), overrides


def test_the_config_refuses_what_cannot_work():
    from grpo.config import ConfigError

    for overrides, message in [
        (["loss.loss_type=cispo"], "cispo with loss.epsilon_high null"),
        (["loss.loss_type=sapo", "loss.delta=2"], "loss.delta is set but loss.loss_type sapo has no clipped branch"),
        (["loss.delta=1.1"], r"loss.delta 1.1 is not above 1 \+ epsilon_high = 1.2"),
        (["loss.loss_type=vespo", "loss.sampler_is_correction=true", "loss.sampler_is_mode=sequence_mask",
          "rollout.engine=vllm"], "sequence_mask with loss.loss_type vespo"),
        (["loss.entropy_coef=0.1", "rollout.repetition_penalty=1.1"], "loss.entropy_coef cannot be combined"),
        (["algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.advantage_estimator=rloo"],
         "normalize_then_sum is the grpo estimator's"),
        (["algorithm.multi_objective_aggregation=normalize_then_sum", "loss.scale_rewards=batch"],
         "loss.scale_rewards is 'batch' with algorithm.multi_objective_aggregation normalize_then_sum"),
        (["loss.top_entropy_quantile=1.5"], "loss.top_entropy_quantile: 1.5 is out of range"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_normalize_then_sum_reaches_the_advantages():
    """GDPO's aggregation: each reward normalised in its group, then the weighted sum over the batch
    (``multi_reward_advantages``, checked against TRL); the default stays the estimator on the weighted total."""
    from dataclasses import replace

    from grpo.algorithm import group_advantages, multi_reward_advantages
    from grpo.step.experience import finish_experience
    from grpo.training.settings import experience_settings
    from grpo.tasks import run_task

    batch = random_batch(50, N=6, seed=1)
    parts = torch.tensor([[1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [0.0, 0.0], [1.0, 0.5], [1.0, 0.0]])
    batch = replace(batch, reward_parts=parts, reward_weights=[1.0, 2.0], rewards=parts @ torch.tensor([1.0, 2.0]),
                    old_logprobs=None, ref_logprobs=None)
    for aggregation, want in (("normalize_then_sum", multi_reward_advantages(parts, 2, torch.tensor([1.0, 2.0]),
                                                                             "normalize_then_sum")),
                              ("sum_then_normalize", group_advantages(batch.rewards, 2))):
        cfg = load_config(None, ["rollout.num_generations=2", f"algorithm.multi_objective_aggregation={aggregation}"])
        settings = experience_settings(cfg, None, task=run_task(cfg), decoupled_sampler=False,
                                       engine_holds_weights=False)
        assert torch.allclose(finish_experience(batch, None, None, settings).advantages, want)


def test_the_adaptive_coefficient_moves_after_every_update_and_is_what_the_update_applies(tiny_tokenizer):
    """TRL's use_adaptive_entropy through the update: no bonus until the measured entropy reaches the target, then
    the coefficient the controller holds; each update's gradient is a fixed-coefficient update's with the
    coefficient the controller applied (the learner records gradients without stepping, so the weights stay)."""
    from dataclasses import replace

    from grpo.algorithm import AdaptiveEntropyState, adaptive_entropy_step
    from grpo.step.entropy_control import EntropyControl, entropy_control

    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).double()
    batch = _near_policy(random_batch(len(tiny_tokenizer), seed=3), model)
    cfg = load_config(None, ["rollout.temperature=0.9", "rollout.max_completion_length=7", "loss.num_iterations=3",
                             "loss.adaptive_entropy=true", "loss.entropy_coef=0.1", "loss.entropy_target=100",
                             "loss.entropy_coef_delta=0.05"])
    settings = loss_settings(cfg, None, "cpu")
    control = entropy_control(cfg, None)
    learner = RecordingLearner(model)
    step = train_on_batch(learner, batch, settings, DistInfo(), entropy=control)
    # the entropy (a few nats) is below the target 100: no bonus in the first update (nothing measured yet), then
    # 0.1 + 0.05 after it, 0.2 after the second; logged: the coefficient after each update (TRL's entropy_coef)
    assert [u.entropy_coef for u in step.updates] == pytest.approx([0.15, 0.2, 0.25])
    assert control.state.coef == pytest.approx(0.25) and control.state.last_entropy == pytest.approx(
        step.updates[-1].entropy, rel=1e-5)
    assert step.totals["entropy_coef"] == pytest.approx(0.25) and step.totals["policy_loss"] != step.totals["loss"]
    for update, coef in ((0, 0.0), (1, 0.15), (2, 0.2)):
        fixed = RecordingLearner(model)
        old = {"old_logprobs": batch.old_logprobs}
        train_on_batch(fixed, replace(batch, **old), replace(settings, adaptive_entropy=False, entropy_coef=coef,
                                                             num_iterations=1), DistInfo())
        for name, g in fixed.grads[0].items():
            assert torch.allclose(learner.grads[update][name], g, atol=1e-9, rtol=1e-6), (update, name)
    # above the target the bonus never engages and the coefficient steps down to its floor
    low = EntropyControl(AdaptiveEntropyState(0.1), target=0.0, coef_delta=0.05, coef_min=0.0, coef_max=1.0)
    step = train_on_batch(RecordingLearner(model), batch, settings, DistInfo(), entropy=low)
    assert [u.entropy_coef for u in step.updates] == pytest.approx([0.05, 0.0, 0.0]) and low.state.coef == 0.0
    fixed = RecordingLearner(model)
    train_on_batch(fixed, batch, replace(settings, adaptive_entropy=False, entropy_coef=0.0), DistInfo())
    assert all(torch.equal(fixed.grads[0][n], g) for n, g in learner_grads(RecordingLearner(model), batch, settings,
                                                                             low).items())
    # the run's checkpoint keeps the state; a resumed run's controller starts from it
    saved = control.state_dict()
    assert entropy_control(cfg, {"adaptive_entropy": saved}).state == control.state
    assert entropy_control(cfg, None).state == AdaptiveEntropyState(0.1)
    assert adaptive_entropy_step(AdaptiveEntropyState(0.25, 3.0), (9.0, 3.0), target=100, coef_delta=0.05,
                                 coef_min=0.0, coef_max=0.27).coef == 0.27


def learner_grads(learner, batch, settings, control):
    """The first update's gradient of one step under ``control`` (a fresh one: its bonus is gated off)."""
    from grpo.algorithm import AdaptiveEntropyState
    from grpo.step.entropy_control import EntropyControl

    fresh = EntropyControl(AdaptiveEntropyState(0.1), control.target, control.coef_delta, control.coef_min,
                           control.coef_max)
    train_on_batch(learner, batch, settings, DistInfo(), entropy=fresh)
    return learner.grads[0]
