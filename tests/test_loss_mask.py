"""Multi-turn rows (issue 27): ``loss_mask`` keeps the environment's tokens out of the loss, every aggregation's
token counts, the KL, the entropy, the sampler correction, mask_truncated_completions, PPO's GAE and the
critic's loss, while the forward passes still see them as context.

The batch below has environment tokens between sampled turns; old, reference and sampler log-probs hold NaN
on them, so any leak into a loss or a statistic makes it NaN. The loss is checked against a loop over each
row's sampled positions, written without a mask."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from algorithm_references import ref_value_loss
from step_helpers import RecordingLearner, settings_with

from grpo.algorithm import LOSS_AGGREGATIONS, policy_loss, sampler_importance_weights
from grpo.algorithm.ppo import actions_first, ppo_advantages
from grpo.critic.critic_update import CriticSettings, train_critic
from grpo.critic.value_model import ValueModel, completion_values
from grpo.models.tiny import build_qwen2
from grpo.step.logprob_pass import LogprobPass
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch
from grpo.parallel.distributed import DistInfo

# Rows (P = 2 prompts, G = 2): s = sampled, e = environment, . = padding.
#   0: s s e e e s s .    two turns around a tool result
#   1: s s s s s . . .    answered at once (loss_mask = completion_mask)
#   2: s e e s e s s s    three turns, the last one fills the row
#   3: s s s e e s . .    truncated (no EOS)
LOSS_MASK = [[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1, 0, 0]]
LENGTHS = [7, 5, 8, 6]
N, LP, LC = 4, 4, 8
FAST_PASS = LogprobPass(share_prompts=False, column_bucket=1)


def sampled_positions(row: int) -> list[int]:
    return [t for t, m in enumerate(LOSS_MASK[row]) if m]


def multi_turn_batch(model, vocab: int, seed: int = 0, temperature: float = 0.9) -> RolloutBatch:
    """Old/ref log-probs near the model's (ratios near 1, some clipped); NaN on environment tokens and padding."""
    gen = torch.Generator().manual_seed(seed)
    completion_mask = (torch.arange(LC)[None] < torch.tensor(LENGTHS)[:, None]).long()
    loss_mask = torch.tensor(LOSS_MASK)
    prompt_mask = torch.ones(N, LP, dtype=torch.long)
    prompt_mask[1, :2] = 0
    generation = Generation(
        prompt_ids=torch.randint(3, vocab, (N, LP), generator=gen), prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, vocab, (N, LC), generator=gen), completion_mask=completion_mask,
        truncated=torch.tensor([False, False, False, True]), completions=[""] * N, loss_mask=loss_mask)
    with torch.no_grad():
        logp = completion_logprobs(model, generation.prompt_ids, prompt_mask, generation.completion_ids,
                                   completion_mask, temperature, share_prompts=False, column_bucket=1)
    not_sampled = loss_mask == 0

    def near(scale: float) -> torch.Tensor:
        return (logp + scale * torch.randn(N, LC, generator=gen)).masked_fill(not_sampled, float("nan"))

    return RolloutBatch(
        generation=generation, rewards=torch.randn(N, generator=gen), reward_parts=torch.zeros(N, 1),
        reward_names=["r"], advantages=torch.randn(N, generator=gen), old_logprobs=near(0.3),
        ref_logprobs=near(0.3), prompts=["", ""], sampler_logprobs=near(0.3))


def loop_loss(logp, old, ref, adv, rows: list[list[int]], loss_type: str, beta: float, eps: float,
              max_len: int, sampler=None, cap: float = 3.0) -> float:
    """The loss over each row's listed (sampled) positions, in plain Python; ``sampler``: TRL's
    sequence_truncate weight min(prod_t exp(old - sampler), cap) of the row's sampled tokens."""
    per_row, total, count = [], 0.0, 0
    for i, positions in enumerate(rows):
        w = 1.0 if sampler is None else min(math.exp(sum(old[i][t] - sampler[i][t] for t in positions)), cap)
        terms = []
        for t in positions:
            ratio = math.exp(logp[i][t] - old[i][t])
            surrogate = min(ratio * adv[i], min(max(ratio, 1 - eps), 1 + eps) * adv[i])
            d = ref[i][t] - logp[i][t]
            terms.append(-(w * surrogate - beta * (math.exp(d) - d - 1)))
        per_row.append(sum(terms) / len(terms) if terms else 0.0)
        total, count = total + sum(terms), count + len(terms)
    if loss_type == "grpo":
        return sum(per_row) / len(rows)
    if loss_type in ("bnpo", "dapo"):
        return total / count
    return total / (len(rows) * max_len)  # dr_grpo


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("truncated_out", [False, True])
def test_the_loss_of_a_multi_turn_batch_is_the_loop_over_its_sampled_tokens(model, tiny_tokenizer, loss_type,
                                                                              truncated_out):
    batch = multi_turn_batch(model, len(tiny_tokenizer))
    s = settings_with(loss_type=loss_type, beta=0.1, max_completion_length=LC, micro_batch_size=2,
                      mask_truncated_completions=truncated_out, sampler_is_mode="sequence_truncate",
                      logprob_pass=FAST_PASS)
    stats = train_on_batch(RecordingLearner(model), batch, s, DistInfo()).totals
    g = batch.generation
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                            s.temperature, share_prompts=False, column_bucket=1, with_entropy=True)
    # mask_truncated_completions: row 3 (no EOS) keeps no token; grpo still divides by all 4 rows.
    rows = [sampled_positions(i) if not (truncated_out and g.truncated[i]) else [] for i in range(N)]
    want = loop_loss(logp.double().tolist(), batch.old_logprobs.double().tolist(), batch.ref_logprobs.double().tolist(),
                     batch.advantages.double().tolist(), rows, loss_type, s.beta, s.epsilon, LC,
                     sampler=batch.sampler_logprobs.double().tolist(), cap=s.sampler_is_cap)
    assert math.isfinite(stats["loss"]) and abs(stats["loss"] - want) < 1e-6
    # The entropy is the token mean over the sampled tokens (truncated rows included: it describes the policy).
    sampled = [(i, t) for i in range(N) for t in sampled_positions(i)]
    want_entropy = sum(float(entropy[i, t]) for i, t in sampled) / len(sampled)
    assert stats["entropy"] == pytest.approx(want_entropy, rel=1e-6)  # near ln(V) ~ 6: float32 resolves ~5e-7
    assert all(math.isfinite(stats[k]) for k in ("kl", "clip_fraction", "ratio_mean", "sampler_is/weight_mean",
                                                 "sampler_is/logprob_diff"))


def test_gradients_at_environment_positions_are_exactly_zero(model, tiny_tokenizer):
    batch = multi_turn_batch(model, len(tiny_tokenizer))
    captured = []

    def keep(module, args, out):  # the logits, kept with their gradient
        out.retain_grad()
        captured.append(out)

    handle = model.lm_head.register_forward_hook(keep)
    try:
        s = settings_with(loss_type="bnpo", beta=0.1, max_completion_length=LC, micro_batch_size=N,
                          sampler_is_mode="token_truncate", logprob_pass=FAST_PASS)
        train_on_batch(RecordingLearner(model), batch, s, DistInfo()).totals
    finally:
        handle.remove()
    (logits,) = captured  # [N, LC + 1, V]: position t predicts completion token t (the last predicts nothing)
    assert logits.shape[:2] == (N, LC + 1)
    per_position = logits.grad.abs().amax(-1)  # [N, LC + 1]
    loss_mask = torch.nn.functional.pad(torch.tensor(LOSS_MASK), (0, 1))  # [N, LC + 1]
    assert torch.equal(per_position[loss_mask == 0], torch.zeros(int((loss_mask == 0).sum())))
    assert bool((per_position[loss_mask == 1] > 0).all())


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
def test_policy_loss_gradient_wrt_logprobs_is_zero_off_the_sampled_tokens(loss_type):
    gen = torch.Generator().manual_seed(1)
    mask = torch.tensor(LOSS_MASK)
    logp = (-torch.rand(N, LC, generator=gen, dtype=torch.float64)).requires_grad_()
    old = (logp.detach() + 0.2 * torch.randn(N, LC, generator=gen, dtype=torch.float64)).masked_fill(mask == 0, math.nan)
    weights, _ = sampler_importance_weights(old, old.detach() - 0.1, mask, 3.0, "sequence_mask")
    loss, _ = policy_loss(logp, old, old.flip(0), torch.randn(N, generator=gen, dtype=torch.float64), mask,
                          epsilon=0.2, beta=0.1, loss_type=loss_type, max_completion_length=LC,
                          importance_sampling_level="sequence", sampler_weights=weights)
    loss.backward()
    assert torch.equal(logp.grad[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=torch.float64))
    assert bool((logp.grad[mask == 1] != 0).all())


def test_a_loss_mask_equal_to_the_completion_mask_changes_nothing(model, tiny_tokenizer):
    batch = multi_turn_batch(model, len(tiny_tokenizer))
    g = batch.generation
    finite = torch.nan_to_num  # a single-turn batch: every completion token sampled, no NaN to hide
    single = replace(batch, old_logprobs=finite(batch.old_logprobs, -1.0), ref_logprobs=finite(batch.ref_logprobs, -2.0),
                     sampler_logprobs=finite(batch.sampler_logprobs, -1.5),
                     generation=replace(g, loss_mask=None))
    same = replace(single, generation=replace(g, loss_mask=g.completion_mask.clone()))
    results = []
    for b in (single, same):
        learner = RecordingLearner(model)
        s = settings_with(loss_type="grpo", beta=0.1, max_completion_length=LC, micro_batch_size=2,
                          sampler_is_mode="token_truncate", mask_truncated_completions=True, logprob_pass=FAST_PASS)
        results.append((train_on_batch(learner, b, s, DistInfo()).totals, learner.grads[0]))
    (stats_a, grads_a), (stats_b, grads_b) = results
    assert stats_a == stats_b
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)


def test_gae_chains_over_the_sampled_tokens_and_skips_the_environment_s():
    # One row: s e e s s . (sampled at 0, 3, 4). gamma = 0.9, lam = 0.8, reward 1 at the last sampled token (4),
    # no KL. The actions' values are V0 = 0.5, V3 = 0.2, V4 = 0.4 (the environment's 1.0 and 2.0 are never read):
    #   A4 = 1 - 0.4 = 0.6
    #   A3 = (0 + 0.9 * 0.4 - 0.2) + 0.9 * 0.8 * 0.6 = 0.16 + 0.432 = 0.592
    #   A0 = (0 + 0.9 * 0.2 - 0.5) + 0.9 * 0.8 * 0.592 = -0.32 + 0.42624 = 0.10624
    # returns = A + V: 0.60624, 0.792, 1.0; the environment's positions and padding get 0.
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    values = torch.tensor([[0.5, 1.0, 2.0, 0.2, 0.4, 9.0]], dtype=torch.float64)
    adv, ret = ppo_advantages(torch.tensor([1.0], dtype=torch.float64), values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(ret, torch.tensor([[0.60624, 0, 0, 0.792, 1.0, 0]], dtype=torch.float64), atol=1e-12, rtol=0)
    raw = torch.tensor([0.10624, 0.592, 0.6], dtype=torch.float64)
    whitened = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)  # Bessel's variance, over the sampled tokens only
    want = torch.zeros(1, 6, dtype=torch.float64)
    want[0, [0, 3, 4]] = whitened
    assert torch.allclose(adv, want, atol=1e-12, rtol=0)
    # The KL in the reward is read at the sampled tokens only (NaN on the environment's would otherwise spread).
    kl = torch.tensor([[0.1, math.nan, math.nan, 0.2, 0.3, math.nan]], dtype=torch.float64)
    _, ret_kl = ppo_advantages(torch.tensor([1.0], dtype=torch.float64), values, mask, gamma=1.0, lam=1.0, kl=kl,
                               kl_coef=0.5)
    # lam = gamma = 1: each return is the sum of the rewards from there on: 1 - 0.5 * (kl of the later actions).
    assert torch.allclose(ret_kl, torch.tensor([[0.7, 0, 0, 0.75, 0.85, 0]], dtype=torch.float64), atol=1e-12, rtol=0)


def test_gae_with_a_prefix_mask_is_unchanged_by_the_packing():
    gen = torch.Generator().manual_seed(3)
    mask = (torch.arange(7)[None] < torch.tensor([7, 3, 5])[:, None]).long()
    assert torch.equal(actions_first(mask), torch.arange(7).expand(3, 7))
    values, rewards = torch.randn(3, 7, generator=gen), torch.randn(3, generator=gen)
    from grpo.algorithm import gae_advantages, kl_penalized_token_rewards, whiten

    token_rewards = kl_penalized_token_rewards(rewards, torch.zeros(3, 7), mask, 0.0)
    want_adv, want_ret = gae_advantages(token_rewards, values, mask, 0.95, 0.9)
    adv, ret = ppo_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    assert torch.equal(adv, whiten(want_adv, mask)) and torch.equal(ret, want_ret)


def value_model(tokenizer) -> ValueModel:
    lm = build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    model = ValueModel(lm.model, lm.config.hidden_size)
    torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(0))
    return model


def test_the_critic_loss_counts_the_sampled_tokens_only(tiny_tokenizer):

    batch = multi_turn_batch(build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0), len(tiny_tokenizer))
    g = batch.generation
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(N, LC, generator=gen) * g.completion_mask
    _, returns = ppo_advantages(batch.rewards, values, g.loss_mask, gamma=1.0, lam=0.95)
    batch = replace(batch, values=values, returns=returns.masked_fill(g.loss_mask == 0, math.nan))
    stats = train_critic(RecordingLearner(value_model(tiny_tokenizer)), batch,
                         CriticSettings(value_clip=0.2, micro_batch_size=2, num_iterations=1))
    with torch.no_grad():
        v = completion_values(value_model(tiny_tokenizer), g.prompt_ids, g.prompt_mask, g.completion_ids,
                              g.completion_mask)
    want, _ = ref_value_loss(v.tolist(), values.tolist(), batch.returns.tolist(), LOSS_MASK, 0.2)
    # float32 against a float64 reference: a loss near 15 is resolved to ~1e-6 (one ulp), so the bound is relative
    assert stats["loss/value"] == pytest.approx(want, rel=1e-6)
    assert math.isfinite(stats["critic/explained_variance"])
