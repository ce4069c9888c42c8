"""PPO's critic: token-level advantages in the policy loss, ``ppo_advantages`` against the loop
references, the value model's positions, the critic update and its checkpoint, the config rules."""

from __future__ import annotations

import math

import pytest
import torch
from algorithm_references import ragged_mask, ref_gae, ref_kl_token_rewards, ref_policy_loss, ref_value_loss, ref_whiten
from step_helpers import RecordingLearner

from grpo.algorithm import policy_loss
from grpo.algorithm.ppo import ppo_advantages
from grpo.config import ConfigError, CriticConfig, ModelConfig, OptimConfig, load_config
from grpo.critic import (
    Critic,
    CriticSettings,
    ValueModel,
    completion_values,
    generation_values,
    load_critic,
    load_value_model,
    save_critic,
    train_critic,
    value_fit,
)
from grpo.models.tiny import build_qwen2
from grpo.run.checkpoint import CheckpointError
from grpo.parallel.learners import TorchLearner
from grpo.parallel.optim import build_optimizer, build_scheduler

TOL = 1e-6


# ---------------------------------------------------------------- policy_loss with [N, L] advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_level_advantages_match_the_loop_reference(seed, level, loss_type):
    gen = torch.Generator().manual_seed(seed)
    N, L = 5, 6
    logp = -torch.rand(N, L, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.4
    ref = logp + torch.randn(N, L, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(N, L, generator=gen, dtype=torch.float64)
    mask = ragged_mask(N, L, gen).double()
    adv_with_junk = adv.masked_fill(mask == 0, float("inf"))  # padding's advantage must never leak in
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, old, ref, adv_with_junk, mask, beta=0.04, loss_type=loss_type,
                              max_completion_length=L, importance_sampling_level=level)
    want = ref_policy_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 0.04,
                           loss_type, L, level=level)
    got = (loss.item(), stats["kl"].item(), stats["clip_fraction"].item(), stats["ratio_mean"].item())
    assert all(abs(g - w) < TOL for g, w in zip(got, want)), (got, want)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_per_token_advantages_constant_over_a_row_equal_the_per_completion_ones():
    gen = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(4, 5, generator=gen), -torch.rand(4, 5, generator=gen)
    adv, mask = torch.randn(4, generator=gen), ragged_mask(4, 5, gen).float()
    per_row, _ = policy_loss(logp, old, None, adv, mask, beta=0.0)
    per_token, _ = policy_loss(logp, old, None, adv[:, None].expand(4, 5), mask, beta=0.0)
    assert per_token.item() == per_row.item()


def test_token_advantages_hand_computed():
    # One row, ratio 1 everywhere (logp = old): the objective is the advantage itself, and the grpo
    # aggregation is the mean over the two real tokens: -(2 + -1) / 2 = -0.5. The padded token's 100 is ignored.
    logp = torch.zeros(1, 3)
    loss, _ = policy_loss(logp, logp, None, torch.tensor([[2.0, -1.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]),
                          beta=0.0)
    assert loss.item() == -0.5


def test_advantages_of_another_shape_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[N\]=2 or \[N, L\]=\(2, 3\), got \(2, 4\)"):
        policy_loss(x, x, None, torch.zeros(2, 4), torch.ones(2, 3), beta=0.0)


# ---------------------------------------------------------------- ppo_advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam,kl_coef", [(1.0, 0.95, 0.0), (0.9, 1.0, 0.1), (1.0, 0.0, 0.05)])
def test_ppo_advantages_match_the_composed_loop_references(seed, gamma, lam, kl_coef):
    gen = torch.Generator().manual_seed(seed)
    N, L = 6, 7
    mask = ragged_mask(N, L, gen).double()
    rewards = torch.randn(N, generator=gen, dtype=torch.float64)
    values = torch.randn(N, L, generator=gen, dtype=torch.float64)
    kl = torch.randn(N, L, generator=gen, dtype=torch.float64)
    adv, ret = ppo_advantages(rewards, values, mask, gamma=gamma, lam=lam, kl=kl, kl_coef=kl_coef)
    token_rewards = ref_kl_token_rewards(rewards.tolist(), kl.tolist(), mask.tolist(), kl_coef)
    want_adv, want_ret = ref_gae(token_rewards, values.tolist(), mask.tolist(), gamma, lam)
    want_adv = ref_whiten(want_adv, mask.tolist(), 1e-8)
    assert torch.allclose(adv, torch.tensor(want_adv, dtype=torch.float64), atol=TOL, rtol=0)
    assert torch.allclose(ret, torch.tensor(want_ret, dtype=torch.float64), atol=TOL, rtol=0)


def test_ppo_advantages_hand_computed():
    # Rows of 2 and 1 real tokens, gamma = lam = 1, values 0, rewards 1 and -1, no KL: every real token's
    # return is its row's reward, (1, 1) and (-1); the advantages (1, 1, -1) whiten with mean 1/3 and
    # Bessel std sqrt(((2/3)^2 * 2 + (4/3)^2) / 2) = sqrt(4/3).
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv, ret = ppo_advantages(torch.tensor([1.0, -1.0], dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64),
                              mask, gamma=1.0, lam=1.0)
    assert torch.equal(ret, torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64))
    s = math.sqrt(4 / 3 + 1e-8)
    assert torch.allclose(adv, torch.tensor([[2 / 3 / s, 2 / 3 / s], [-4 / 3 / s, 0.0]], dtype=torch.float64),
                          atol=1e-12)


def test_value_fit_hand_computed():
    # returns (1, 3), values (1, 2): Var(R) = 1, Var(R - V) = Var(0, 1) = 0.25 -> explained variance 0.75.
    fit = value_fit(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    assert fit == {"critic/value_mean": 1.5, "critic/return_mean": 2.0, "critic/explained_variance": 0.75}
    assert math.isnan(value_fit(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))["critic/explained_variance"])


# ---------------------------------------------------------------- the value model


def value_model(tokenizer, seed: int = 0) -> ValueModel:
    lm = build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=seed)
    model = ValueModel(lm.model, lm.config.hidden_size)
    torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(seed))
    return model


def test_values_are_read_where_each_completion_token_is_predicted(tiny_tokenizer):
    # Row 0's prompt is left-padded by 2; row 1 has a 2-token completion. The value of completion token t
    # is the full model's value at the position just before it, whatever padding surrounds the row.
    model = value_model(tiny_tokenizer).eval()
    gen = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = torch.randint(3, 100, (2, 5), generator=gen), torch.randint(3, 100, (2, 4), generator=gen)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        got = completion_values(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [2, 4]
        for row, (start, length) in enumerate([(2, 4), (0, 2)]):
            ids = torch.cat([prompt_ids[row, start:], completion_ids[row, :length]])[None]  # unpadded sequence
            positions = torch.arange(ids.shape[1])[None]
            alone = model(ids, torch.ones_like(ids), positions)[0]  # [T]
            Lp = 5 - start
            assert torch.allclose(got[row, :length], alone[Lp - 1:Lp - 1 + length], atol=1e-5), row


def test_a_new_value_head_starts_at_zero_and_stays_float32_under_autocast(tiny_model_dir):
    model = load_value_model(CriticConfig(), ModelConfig(name_or_path=str(tiny_model_dir)), torch.device("cpu"))
    ids = torch.randint(3, 100, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = model(ids, torch.ones_like(ids), torch.arange(6).expand(2, 6))
    assert values.dtype == torch.float32 and torch.equal(values, torch.zeros(2, 6))
    assert not hasattr(model.body, "lm_head")  # the body only


def test_lora_critic_trains_adapter_and_head_only(tiny_model_dir):
    model = load_value_model(CriticConfig(lora_r=2), ModelConfig(name_or_path=str(tiny_model_dir)),
                             torch.device("cpu"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all(n.startswith("value_head") or "lora_" in n for n in trainable)


def test_a_missing_critic_path_names_the_key():
    with pytest.raises(ConfigError, match="critic.name_or_path: '/nonexistent/critic' does not exist"):
        load_value_model(CriticConfig(name_or_path="/nonexistent/critic"), ModelConfig(), torch.device("cpu"))


# ---------------------------------------------------------------- the update and the checkpoint


def rollout_with_values(tokenizer, N: int = 4, seed: int = 0):
    from grpo.rollout.generation import Generation
    from grpo.step.records import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    Lp, Lc = 4, 6
    lengths = torch.randint(1, Lc + 1, (N,), generator=gen)
    completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    values = torch.randn(N, Lc, generator=gen) * completion_mask
    rewards = torch.randn(N, generator=gen)
    advantages, returns = ppo_advantages(rewards, values, completion_mask, gamma=1.0, lam=0.95)
    return RolloutBatch(
        generation=Generation(prompt_ids=torch.randint(3, 100, (N, Lp), generator=gen),
                              prompt_mask=torch.ones(N, Lp, dtype=torch.long),
                              completion_ids=torch.randint(3, 100, (N, Lc), generator=gen),
                              completion_mask=completion_mask, truncated=torch.zeros(N, dtype=torch.bool),
                              completions=[""] * N),
        rewards=rewards, reward_parts=rewards[:, None], reward_names=["r"], advantages=advantages,
        old_logprobs=None, ref_logprobs=None, prompts=[""] * (N // 2), values=values, returns=returns)


def make_critic(model: ValueModel, lr: float = 1e-2) -> Critic:
    optim = OptimConfig(learning_rate=lr, lr_scheduler_type="constant")
    optimizer = build_optimizer(model, optim, lora=False)
    scheduler = build_scheduler(optimizer, optim, 10)
    return Critic(model, TorchLearner(model, optimizer, scheduler, 1.0), optimizer, scheduler)


def test_critic_micro_batches_accumulate_to_the_whole_batch_gradient(tiny_tokenizer):
    batch = rollout_with_values(tiny_tokenizer)
    results = {}
    for micro in (4, 2, 1):
        learner = RecordingLearner(value_model(tiny_tokenizer))
        stats = train_critic(learner, batch, CriticSettings(value_clip=0.2, micro_batch_size=micro, num_iterations=1))
        results[micro] = (learner.grads[0], stats["loss/value"])
    whole, whole_loss = results[4]
    # The loss at the start is the whole batch's masked mean of value_loss against the reference.
    with torch.no_grad():
        v = completion_values(value_model(tiny_tokenizer), batch.generation.prompt_ids, batch.generation.prompt_mask,
                              batch.generation.completion_ids, batch.generation.completion_mask)
    want, _ = ref_value_loss(v.tolist(), batch.values.tolist(), batch.returns.tolist(),
                             batch.generation.completion_mask.tolist(), 0.2)
    assert abs(whole_loss - want) < 1e-5
    for micro in (2, 1):
        part, part_loss = results[micro]
        assert abs(part_loss - whole_loss) < 1e-5
        for name, g in whole.items():
            assert torch.allclose(part[name], g, atol=1e-6, rtol=1e-4), (micro, name)


def test_critic_mini_batches_are_one_update_each_on_the_policys_mini_batches(tiny_tokenizer):
    # train.mini_batches 2: the critic takes two updates per pass, on the groups the policy's mini-batches hold
    # ({0, 2} and {1, 3}), each the token mean of its own mini-batch.
    from grpo.step.batching import select_groups

    batch = rollout_with_values(tiny_tokenizer, N=8)
    learner = RecordingLearner(value_model(tiny_tokenizer))
    stats = train_critic(learner, batch, CriticSettings(0.2, 2, num_iterations=1, mini_batches=2))
    assert len(learner.grads) == 2
    losses = []
    for update, groups in zip(learner.grads, ([0, 2], [1, 3])):
        alone = RecordingLearner(value_model(tiny_tokenizer))
        losses.append(train_critic(alone, select_groups(batch, groups), CriticSettings(0.2, 2, 1))["loss/value"])
        for name, grad in alone.grads[0].items():
            assert torch.allclose(update[name], grad, atol=1e-6, rtol=1e-4), name
    assert stats["loss/value"] == pytest.approx(sum(losses) / 2, abs=1e-6)  # the mean over its updates


def test_critic_updates_lower_the_value_loss_and_move_every_parameter(tiny_tokenizer):
    torch.manual_seed(0)
    model = value_model(tiny_tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    critic = make_critic(model, lr=3e-3)
    batch = rollout_with_values(tiny_tokenizer)
    batch.values = torch.zeros_like(batch.values)  # no clipping range to hide behind: targets far from 0
    settings = CriticSettings(value_clip=100.0, micro_batch_size=2, num_iterations=1)
    losses = [train_critic(critic.learner, batch, settings)["loss/value"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged


def test_critic_checkpoint_round_trip_and_a_checkpoint_without_one(tiny_tokenizer, tmp_path):
    critic = make_critic(value_model(tiny_tokenizer, seed=1))
    train_critic(critic.learner, rollout_with_values(tiny_tokenizer), CriticSettings(0.2, 2, 1))
    save_critic(tmp_path / "critic", critic)
    fresh = make_critic(value_model(tiny_tokenizer, seed=2))
    load_critic(tmp_path / "critic", fresh)
    for (name, a), b in zip(critic.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.optimizer.state_dict()["state"].keys() == critic.optimizer.state_dict()["state"].keys()
    assert fresh.scheduler.state_dict()["last_epoch"] == critic.scheduler.state_dict()["last_epoch"] == 1
    with pytest.raises(CheckpointError, match="saved without a critic"):
        load_critic(tmp_path / "nothing", fresh)
    (tmp_path / "critic" / "value_head.safetensors").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="value_head.safetensors"):
        load_critic(tmp_path / "critic", fresh)


def test_generation_values_batches_like_one_pass(tiny_tokenizer):
    model = value_model(tiny_tokenizer).eval()
    gen = rollout_with_values(tiny_tokenizer, N=6).generation
    whole = generation_values(model, gen, batch_size=6)
    parts = generation_values(model, gen, batch_size=4)
    assert torch.allclose(whole * gen.completion_mask, parts * gen.completion_mask, atol=1e-5)


# ---------------------------------------------------------------- the config rules


@pytest.mark.parametrize("overrides,key", [
    (["rollout.num_generations=1"], "rollout.num_generations is 1"),
    (["algorithm.kl_penalty=reward"], "algorithm.kl_penalty is 'reward' but algorithm.advantage_estimator"),
    (["algorithm.advantage_estimator=gae", "algorithm.kl_penalty=reward", "loss.beta=0"], "loss.beta is 0"),
    (["critic.learning_rate=1e-4"], "critic is set but algorithm.advantage_estimator is not gae"),
    (["algorithm.advantage_estimator=gae", "train.mode=decoupled"], "gae \\(PPO\\) runs colocated only"),
    (["algorithm.advantage_estimator=gae", "train.deepspeed=ds.json"], "train.deepspeed cannot be combined"),
])
def test_ppo_config_rules_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_ppo_with_one_completion_per_prompt_is_valid():
    cfg = load_config(None, ["algorithm.advantage_estimator=gae", "rollout.num_generations=1",
                             "train.micro_batch_size=8", "algorithm.kl_penalty=reward", "critic.lora_r=4"])
    assert cfg.rollout.num_generations == 1 and cfg.critic.lora_r == 4


def test_lora_critic_checkpoint_round_trip(tiny_model_dir, tmp_path, tiny_tokenizer):
    model_cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    critic = make_critic(load_value_model(CriticConfig(lora_r=2), model_cfg, torch.device("cpu")))
    # Two updates: the zero head gives the body no gradient in the first, so only the second moves the adapter.
    train_critic(critic.learner, rollout_with_values(tiny_tokenizer), CriticSettings(0.2, 2, 2))
    assert any(v.abs().sum() > 0 for k, v in critic.model.state_dict().items() if "lora_B" in k)
    save_critic(tmp_path / "critic", critic)
    assert (tmp_path / "critic" / "adapter_model.safetensors").is_file()  # the adapter only, not the body
    fresh = make_critic(load_value_model(CriticConfig(lora_r=2), model_cfg, torch.device("cpu")))
    load_critic(tmp_path / "critic", fresh)
    for (name, a), b in zip(critic.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
