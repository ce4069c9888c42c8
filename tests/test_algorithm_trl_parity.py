"""grpo.algorithm against TRL 1.16's own GRPOTrainer code, run on the same float64 inputs: every loss type (cispo,
sapo, luspo, vespo beside the clipped four) at both importance-sampling levels, ``delta``, the high-entropy and
off-policy masks, the entropy bonus and its adaptive coefficient, and the multi-reward advantages. The reference is
always TRL's executed code: ``GRPOTrainer._compute_loss`` / ``_generate_and_score_completions`` called with a stub
``self`` that carries only what they read (one process, its collectives the identity), its model pass replaced by
our tensors, or TRL's static helpers. Loss and gradient agree to 1e-10.

Two float32 artefacts of TRL decide some inputs here (both vanish in a float32 run): ``torch.where(cond, float,
float)`` builds SAPO's temperatures and VESPO's k and lambda as float32 tensors, so their values here are exact in
float32; ``nanstd``'s Bessel factor ``count / (count - 1)`` is an integer division, float32 too, so the group and
batch sizes here are those where it is exact (count - 1 a power of two). Also, hand-computed cases of each
variant, and the frozen results of ``policy_loss``'s defaults."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import types
from dataclasses import dataclass, field
from types import SimpleNamespace as NS

import pytest
import torch

from algorithm_references import ragged_mask
from grpo.algorithm import (
    ADVANTAGE_SCALES,
    LOSS_AGGREGATIONS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    POLICY_OBJECTIVES,
    AdaptiveEntropyState,
    adaptive_entropy_step,
    applied_entropy_coef,
    entropy_bonus,
    entropy_sums,
    high_entropy_mask,
    multi_reward_advantages,
    off_policy_mask,
    policy_loss,
    sampler_importance_weights,
    sapo_objective,
    vespo_weights,
)
from grpo.algorithm.advantages import _NAN_AWARE_SCALES

pytest.importorskip("trl", minversion="1.16")
from trl import GRPOConfig as TRLConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]
F64 = torch.float64


# ---------------------------------------------------------------- TRL, called with a stub self


class OneProcess:
    """accelerate's Accelerator as one process sees it: every collective is the identity."""

    num_processes, process_index, device = 1, 0, torch.device("cpu")

    def __init__(self, sync_gradients: bool = True):
        self.sync_gradients = sync_gradients

    def gather(self, t):
        return t

    def reduce(self, t, reduction="sum"):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t


def trl_trainer(**settings) -> NS:
    """What ``GRPOTrainer._compute_loss`` reads of ``self``: TRL's GRPOConfig defaults, then ``settings``
    (an ``args`` field or a trainer attribute, by name)."""
    args = NS(delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
              vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=True, entropy_target=0.2,
              entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0, steps_per_generation=1)
    t = NS(args=args, accelerator=OneProcess(), model=NS(training=True), loss_type="dapo",
           importance_sampling_level="token", beta=0.0, epsilon_low=0.2, epsilon_high=0.2, top_entropy_quantile=1.0,
           off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
           max_completion_length=None, current_gradient_accumulation_steps=1, entropy_coef=0.0,
           use_adaptive_entropy=False, _last_world_entropy=math.inf, _entropy_window_stats=None, aux_loss_enabled=False,
           _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    for name, value in settings.items():
        setattr(args if hasattr(args, name) else t, name, value)
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy  # as GRPOTrainer.__init__
    t.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, t)
    t.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    t.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return t


@dataclass
class Case:
    """One micro-batch: TRL's inputs and ours. Padding and environment tokens hold junk (finite: TRL would
    turn inf * 0 into NaN), as the passes leave it."""

    completion_mask: torch.Tensor  # [N, L] right padding
    tool_mask: torch.Tensor  # [N, L] 0 on tokens an environment inserted
    logp: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    sampler: torch.Tensor  # the sampling engine's log-probs
    entropy: torch.Tensor  # float32 values (TRL takes its quantile in float32)
    adv: torch.Tensor  # [N] or [N, L]
    global_tokens: torch.Tensor  # the dapo normaliser: this micro-batch's loss tokens and others'

    @property
    def mask(self):
        return self.completion_mask * self.tool_mask

    @property
    def is_weights(self):  # token_truncate at 2.0; 0 on padding as ours are
        return sampler_importance_weights(self.old, self.sampler, self.mask, 2.0)[0]


def make_case(seed: int, N: int = 6, L: int = 7, spread: float = 0.35, token_adv: bool = False,
              entropy_scale: float = 3.0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    completion_mask = ragged_mask(N, L, gen).double()
    tool_mask = (torch.rand(N, L, generator=gen) > 0.2).double()
    tool_mask[:, 0] = 1.0
    junk = completion_mask * tool_mask == 0
    logp = (-torch.rand(N, L, generator=gen, dtype=F64) * 3).masked_fill(junk, -9.0)
    old = logp + torch.randn(N, L, generator=gen, dtype=F64) * spread
    ref = logp + torch.randn(N, L, generator=gen, dtype=F64) * 0.5
    sampler = old + torch.randn(N, L, generator=gen, dtype=F64) * 0.2
    entropy = (torch.rand(N, L, generator=gen) * entropy_scale).double().masked_fill(junk, 50.0)
    adv = torch.randn(N, L, generator=gen, dtype=F64) if token_adv else torch.randn(N, generator=gen, dtype=F64)
    mask = completion_mask * tool_mask
    return Case(completion_mask, tool_mask, logp, old, ref, sampler, entropy, adv, mask.sum() + 5)


@dataclass
class Knobs:
    """One run's settings, by TRL's GRPOConfig names."""

    loss_type: str
    importance_sampling_level: str = "token"
    beta: float = 0.04
    epsilon_high: float = 0.28
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sampler_correction: bool = False  # TRL's use_vllm with vllm_importance_sampling_correction
    entropy_coef: float = 0.0
    objective: dict = field(default_factory=dict)  # sapo_* and vespo_*


def knobs_trainer(k: Knobs, L: int, **settings) -> NS:
    """A stub trainer set as ``k`` says, then as ``settings`` (which win)."""
    return trl_trainer(**{
        **dict(loss_type=k.loss_type, importance_sampling_level=k.importance_sampling_level, beta=k.beta,
               epsilon_high=k.epsilon_high, delta=k.delta, top_entropy_quantile=k.top_entropy_quantile,
               off_policy_mask_threshold=k.off_policy_mask_threshold, use_vllm=k.sampler_correction,
               vllm_importance_sampling_correction=k.sampler_correction, max_completion_length=L + 3,
               entropy_coef=k.entropy_coef, **k.objective),
        **settings})


def trl_loss(case: Case, k: Knobs, trainer: NS | None = None):
    """(loss, d loss / d logp, d loss / d entropy or None, the trainer with its metrics) by TRL; ``trainer``: one
    that carries state between calls (the adaptive entropy controller), else a new one from ``k``."""
    logp, entropy = case.logp.clone().requires_grad_(), case.entropy.clone().requires_grad_()
    N, L = logp.shape
    t = trainer or knobs_trainer(k, L)
    t._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropy, None)
    inputs = dict(prompt_ids=torch.zeros(N, 2, dtype=torch.long), prompt_mask=torch.ones(N, 2, dtype=torch.long),
                  completion_ids=torch.zeros(N, L, dtype=torch.long), completion_mask=case.completion_mask,
                  tool_mask=case.tool_mask, advantages=case.adv, old_per_token_logps=case.old,
                  ref_per_token_logps=case.ref, sampling_per_token_logps=case.sampler,
                  num_items_in_batch=case.global_tokens)
    if k.sampler_correction:  # TRL's ratio is 1 off the loss tokens (its log-prob difference is masked there)
        inputs["importance_sampling_ratio"] = torch.where(case.mask.bool(), case.is_weights, 1.0)
    loss = GRPOTrainer._compute_loss(t, None, inputs)
    grads = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return loss.detach(), *grads, t


def grpo_loss(case: Case, k: Knobs, entropy_coef: float | None = None):
    """(loss, d loss / d logp, d loss / d entropy or None, stats) by grpo.algorithm."""
    logp, entropy = case.logp.clone().requires_grad_(), case.entropy.clone().requires_grad_()
    mask = case.mask
    bonus_mask, keep = mask, None
    if k.top_entropy_quantile < 1.0:
        keep = high_entropy_mask(entropy, mask, k.top_entropy_quantile)  # [N, L]
        bonus_mask = mask * keep
    if k.off_policy_mask_threshold is not None:
        on_policy = off_policy_mask(case.adv, logp, case.sampler, mask, k.off_policy_mask_threshold)
        keep = on_policy if keep is None else keep & on_policy
    loss, stats = policy_loss(
        logp, case.old, case.ref if k.beta else None, case.adv, mask, epsilon=0.2, epsilon_high=k.epsilon_high,
        beta=k.beta, loss_type=k.loss_type, max_completion_length=mask.shape[1] + 3, normalizer=case.global_tokens,
        importance_sampling_level=k.importance_sampling_level,
        sampler_weights=case.is_weights if k.sampler_correction else None, kl_times_ratio=True, delta=k.delta,
        loss_token_mask=keep, **k.objective)
    coef = k.entropy_coef if entropy_coef is None else entropy_coef
    if coef or entropy_coef is not None:
        loss = loss - coef * entropy_bonus(entropy, bonus_mask)
    grads = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return loss.detach(), *grads, stats


def assert_same(ours, theirs):
    for a, b in zip(ours[:3], theirs[:3]):
        if a is None or b is None:  # no gradient reaches the entropy without a bonus, in either
            assert a is None and b is None or (a if b is None else b).abs().max() == 0
        else:
            torch.testing.assert_close(a, b, **TOL)


def cispo_or(loss_type: str, epsilon_high: float = 0.28) -> float:
    return 1.3 if loss_type == "cispo" else epsilon_high  # cispo's epsilon_high caps the ratio itself


# ---------------------------------------------------------------- every loss type


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_each_loss_type_matches_trl(loss_type, level, seed):
    k = Knobs(loss_type, level, epsilon_high=cispo_or(loss_type))
    case = make_case(seed)
    theirs = trl_loss(case, k)  # TRL's defaults of the objectives' settings
    # TRL's sapo_temperature_neg default 1.05 reaches its loss as float32(1.05) = 1.0499999523 (torch.where of
    # Python floats): the same number here
    ours = grpo_loss(case, dataclasses.replace(k, objective=dict(sapo_temperature_neg=float(torch.tensor(1.05))))
                     if loss_type == "sapo" else k)
    assert_same(ours, theirs)
    stats, metrics = ours[3], {name: values[-1] for name, values in theirs[3]._metrics["train"].items()}
    assert stats["kl"].item() == pytest.approx(metrics["kl"], rel=1e-10)
    # shares of counted tokens (or rows), which TRL divides by a float32 count at the sequence level: 1e-7 tells
    # every count apart (one unit is at least 1/42)
    if loss_type in CLIPPED:  # TRL's clip_ratio/* (rows at the sequence level)
        units = stats["clip_units"].item()
        assert stats["clip_region"].item() / units == pytest.approx(metrics["clip_ratio/region_mean"], abs=1e-7)
        assert stats["clip_low"].item() / units == pytest.approx(metrics["clip_ratio/low_mean"], abs=1e-7)
    if loss_type == "cispo" and level == "token":
        assert stats["clip_fraction"].item() == pytest.approx(metrics["cispo_clip_ratio"], abs=1e-7)
    if loss_type == "vespo":
        assert stats["vespo_phi_mean"].item() == pytest.approx(metrics["vespo/phi_seq_mean"], rel=1e-10)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_masks_delta_sampler_weights_and_entropy_bonus_together_match_trl(loss_type, level, seed):
    # Everything at once: the entropy mask and the off-policy mask on the surrogate (not the KL), delta, the
    # sampler weights (folded into vespo's sequence weight), the bonus over the high-entropy tokens; seed 4 with
    # one advantage per token.
    k = Knobs(loss_type, level, epsilon_high=cispo_or(loss_type), delta=1.3, top_entropy_quantile=0.6,
              off_policy_mask_threshold=0.05, sampler_correction=True, entropy_coef=0.03,
              objective=dict(sapo_temperature_neg=1.25) if loss_type == "sapo" else {})  # exact in float32
    case = make_case(seed, spread=0.6, token_adv=seed == 4)
    ours, theirs = grpo_loss(case, k), trl_loss(case, k)
    assert_same(ours, theirs)
    # not vacuous: each knob changes the loss here (delta: test_delta_matches_trl_where_it_caps)
    for off in (dict(top_entropy_quantile=1.0), dict(off_policy_mask_threshold=None), dict(entropy_coef=0.0),
                dict(sampler_correction=False)):
        assert not torch.allclose(grpo_loss(case, dataclasses.replace(k, **off))[0], ours[0], rtol=1e-9), off


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", CLIPPED)
def test_delta_matches_trl_where_it_caps(loss_type, level):
    case = make_case(5, spread=1.5)  # ratios far above delta, with negative advantages among them
    k = Knobs(loss_type, level, delta=1.5)
    ours, theirs = grpo_loss(case, k), trl_loss(case, k)
    assert_same(ours, theirs)
    assert not torch.allclose(ours[0], grpo_loss(case, Knobs(loss_type, level))[0], rtol=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type,objective", [
    ("sapo", dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    ("vespo", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)),
])
def test_sapo_and_vespo_settings_match_trl(loss_type, objective, level):
    # values exact in float32: TRL builds them with torch.where(cond, float, float), a float32 tensor
    case = make_case(6, spread=0.6)
    k = Knobs(loss_type, level, objective=objective)
    ours = grpo_loss(case, k)
    assert_same(ours, trl_loss(case, k))
    assert not torch.allclose(ours[0], grpo_loss(case, Knobs(loss_type, level))[0], rtol=1e-9)


def test_the_adaptive_entropy_coefficient_follows_trls_over_steps():
    # Four optimizer steps of two micro-batches each. The controller's state goes in and out of pure functions
    # here; TRL keeps it on the trainer. Step entropies alternate around the target so that both branches, the
    # max and the min clamp, and the gate (no bonus before a measurement or above the target) all occur.
    settings = dict(entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.05, entropy_coef_min=0.03,
                    entropy_coef_max=0.12)
    k = Knobs("grpo", top_entropy_quantile=0.5)
    t = knobs_trainer(k, 7, use_adaptive_entropy=True, current_gradient_accumulation_steps=2, **settings)
    state, seen = AdaptiveEntropyState(coef=0.1), []
    for step, scale in enumerate([1.0, 3.0, 3.0, 1.0]):
        window = torch.zeros(2, dtype=F64)
        for micro in range(2):
            t.accelerator = OneProcess(sync_gradients=micro == 1)
            case = make_case(10 * step + micro, entropy_scale=scale)
            coef = applied_entropy_coef(state, settings["entropy_target"])
            theirs = trl_loss(case, k, trainer=t)
            ours = grpo_loss(case, k, entropy_coef=coef)
            assert_same([x / 2 if x is not None else None for x in ours[:3]], theirs)  # 1/2: TRL's accumulation
            mask = case.mask * high_entropy_mask(case.entropy, case.mask, 0.5)
            window = window + entropy_sums(case.entropy, mask)
            seen.append(coef)
        state = adaptive_entropy_step(state, window, target=1.0, coef_delta=0.05, coef_min=0.03, coef_max=0.12)
        assert (state.coef, state.last_entropy) == (t.entropy_coef, t._last_world_entropy)
    assert [round(c, 12) for c in seen[::2]] == [0.0, 0.12, 0.0, 0.0] and state.coef == pytest.approx(0.08)


# ---------------------------------------------------------------- TRL's helpers, called directly


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_is_trls(seed, top):
    case = make_case(seed)
    theirs = trl_trainer().get_high_entropy_mask(case.entropy, case.mask, 1 - top)
    assert torch.equal(high_entropy_mask(case.entropy, case.mask, top), theirs)
    empty = torch.zeros_like(case.mask)
    assert not high_entropy_mask(case.entropy, empty, top).any()
    assert torch.equal(trl_trainer().get_high_entropy_mask(case.entropy, empty, 1 - top), torch.zeros_like(theirs))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("token_adv", [False, True])
def test_off_policy_mask_is_trls(seed, token_adv):
    case = make_case(seed, token_adv=token_adv)
    sampler, mask = case.sampler.clone(), case.mask.clone()
    sampler[1, 0] = math.nan  # a token the engine could not score: no evidence, KL 0
    mask[2] = 0.0  # a row without loss tokens: mean KL 0, kept even at threshold 0
    for threshold in (0.0, 0.05, 0.3):
        adv = case.adv if token_adv else case.adv[:, None]  # _compute_loss hands TRL [N, 1]
        theirs = GRPOTrainer.get_off_policy_mask(adv, case.logp, sampler, mask, threshold)
        ours = off_policy_mask(case.adv, case.logp, sampler, mask, threshold)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs.bool())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_weights", [False, True])
def test_vespo_weights_are_trls_gamma_weights(seed, with_weights):
    case = make_case(seed, spread=0.2)
    log_ratio = case.logp - case.old
    params = dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=1.5)
    trl_ratio = torch.where(case.mask.bool(), case.is_weights, 1.0) if with_weights else None
    theirs = GRPOTrainer.get_gamma_weights(case.adv[:, None], log_ratio, case.mask, trl_ratio, **params)
    ours = vespo_weights(log_ratio, case.adv[:, None], case.mask, **params,
                         sampler_weights=case.is_weights if with_weights else None)
    torch.testing.assert_close(ours, theirs, **TOL)


# ---------------------------------------------------------------- several reward functions


def trl_advantages(rewards: torch.Tensor, G: int, weights: torch.Tensor, aggregation: str, scale: str):
    """TRL's ``_generate_and_score_completions`` on one process, generation and scoring stubbed out."""
    N, K = rewards.shape
    t = NS(accelerator=OneProcess(), model=NS(training=True, is_gradient_checkpointing=False),
           environment_factories=None, tools=None, environments=None, _tokenizer=NS(pad_token_id=0),
           pad_to_multiple_of=None, mask_truncated_completions=False, num_iterations=1, use_vllm=False,
           vllm_importance_sampling_correction=False, beta=0.0, num_generations=G,
           args=NS(per_device_train_batch_size=N, steps_per_generation=1, gradient_accumulation_steps=1,
                   gradient_checkpointing_kwargs=None),
           multi_objective_aggregation=aggregation, scale_rewards=scale, reward_weights=weights,
           reward_funcs=[None] * K, reward_func_names=[f"r{i}" for i in range(K)],
           _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
           _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
                  "extra": collections.defaultdict(list)},
           _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False)
    t._generate = lambda prompts: ([[1]] * N, [[2, 3]] * N, None, ["c"] * N, None, {}, None, None)
    t._calculate_rewards = lambda *args: rewards.clone()
    return GRPOTrainer._generate_and_score_completions(t, [{"prompt": "p"}] * N)["advantages"]


def multi_rewards(seed: int) -> torch.Tensor:
    # P = 6 prompts x G = 3: group counts 3 or 2 and a batch count of 17, where TRL's float32 Bessel factor is
    # exact. Row 4 unscored by every function; rows 7 and 8 unscored by function 2 (its group has one score left).
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(18, 3, generator=gen, dtype=F64) * torch.tensor([1.0, 5.0, 0.5], dtype=F64)
    rewards[4] = math.nan
    rewards[1, 0] = rewards[7, 2] = rewards[8, 2] = rewards[12, 1] = math.nan
    rewards[15:18, 0] = 0.5  # a group with one function constant
    return rewards


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("aggregation,scale", [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                                               ("sum_then_normalize", "none"), ("normalize_then_sum", "group")])
def test_multi_reward_advantages_match_trl(aggregation, scale, seed):
    rewards, weights = multi_rewards(seed), torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    theirs = trl_advantages(rewards, 3, weights, aggregation, scale)
    ours = multi_reward_advantages(rewards, 3, weights, aggregation, None if aggregation == "normalize_then_sum"
                                   else scale)
    torch.testing.assert_close(ours, theirs, **TOL)
    assert ours[4] == 0.0  # unscored


def test_multi_reward_hand_case():
    # One prompt, G = 2; function 0 scores (1, 0), function 1 scores (0, 10), weights 1. Summed first, the totals
    # (1, 10) are centred on 5.5 and divided by their std sqrt(2 * 4.5^2) = 6.364 (+1e-4): -/+0.70710, function 1
    # alone decides. Normalised first, function 0 gives +-a, a = 0.5 / (sqrt(0.5) + 1e-4), function 1 -+b,
    # b = 5 / (sqrt(50) + 1e-4): the two nearly cancel (d = a - b = -9e-5, only the eps tells them apart), and the
    # batch step scales (d, -d) to d / (sqrt(2) |d| + 1e-4) = -0.39596.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 10.0]], dtype=F64)
    std = math.sqrt(2 * 4.5 ** 2)
    summed = multi_reward_advantages(rewards, 2)
    assert summed.tolist() == pytest.approx([-4.5 / (std + 1e-4), 4.5 / (std + 1e-4)], abs=1e-12)
    d = 0.5 / (math.sqrt(0.5) + 1e-4) - 5 / (math.sqrt(50) + 1e-4)
    want = d / (math.sqrt(2) * abs(d) + 1e-4)
    got = multi_reward_advantages(rewards, 2, aggregation="normalize_then_sum").tolist()
    assert got == pytest.approx([want, -want], rel=1e-9) and want == pytest.approx(-0.39596, abs=1e-5)
    # Scores that agree, (1, 0) and (3, 0): the same order either way; a constant group is exactly 0.
    agree = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]], dtype=F64)
    assert multi_reward_advantages(agree, 2).tolist()[2:] == [0.0, 0.0]
    # weights [2, 0]: only function 0, doubled: (2, 0) -> +-1 / (1.4142 + 1e-4)
    weighted = multi_reward_advantages(rewards, 2, torch.tensor([2.0, 0.0], dtype=F64))
    assert weighted.tolist() == pytest.approx([1 / (math.sqrt(2) + 1e-4), -1 / (math.sqrt(2) + 1e-4)], abs=1e-12)


def test_multi_reward_agrees_with_group_advantages_and_refuses_bad_input():
    from grpo.algorithm import group_advantages

    rewards = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    for scale in (None, "batch", "none"):  # no NaN: the weighted sum's group_advantages
        torch.testing.assert_close(multi_reward_advantages(rewards, 4, weights, scale=scale),
                                   group_advantages((rewards * weights).sum(-1), 4, scale=scale), rtol=0, atol=1e-14)
    assert set(_NAN_AWARE_SCALES) == set(ADVANTAGE_SCALES)
    with pytest.raises(ValueError, match=r"unknown multi-objective aggregation 'mean'; known: \['normalize_then_sum', "
                                         r"'sum_then_normalize'\]"):
        multi_reward_advantages(rewards, 4, aggregation="mean")
    with pytest.raises(ValueError, match="scale 'batch' applies to 'sum_then_normalize' only"):
        multi_reward_advantages(rewards, 4, aggregation="normalize_then_sum", scale="batch")
    with pytest.raises(ValueError, match="weights must be"):
        multi_reward_advantages(rewards, 4, torch.ones(2))
    with pytest.raises(ValueError, match="not a multiple"):
        multi_reward_advantages(rewards, 3)
    assert list(MULTI_OBJECTIVE_AGGREGATIONS) == ["sum_then_normalize", "normalize_then_sum"]


# ---------------------------------------------------------------- hand-computed cases


def one_token(logp: float, old: float, adv: float, **kwargs):
    x = torch.tensor([[logp]], dtype=F64, requires_grad=True)
    loss, stats = policy_loss(x, torch.tensor([[old]], dtype=F64), None, torch.tensor([adv], dtype=F64),
                              torch.ones(1, 1, dtype=F64), beta=0.0, **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.item(), grad.item(), stats


def test_cispo_hand_case():
    # ratio e^0.5 = 1.6487 above the cap 1.5: the weight is 1.5, detached; objective 1.5 * A * logp =
    # 1.5 * 2 * (-1) = -3, so the loss (one token) is 3 and its gradient -1.5 * 2 = -3 (PPO's clip would give 0).
    loss, grad, stats = one_token(-1.0, -1.5, 2.0, loss_type="cispo", epsilon_high=1.5)
    assert (loss, grad) == pytest.approx((3.0, -3.0), abs=1e-12) and stats["clip_fraction"].item() == 1.0
    # below the cap the weight is the ratio e^-0.5: loss -(0.6065 * 2 * -1) = 1.2131, gradient -1.2131
    loss, grad, stats = one_token(-1.0, -0.5, 2.0, loss_type="cispo", epsilon_high=1.5)
    assert (loss, grad) == pytest.approx((2 * math.exp(-0.5), -2 * math.exp(-0.5)), abs=1e-12)
    assert stats["clip_fraction"].item() == 0.0


def test_sapo_hand_case():
    # On-policy (ratio 1): sigmoid(0) * 4 / tau = 2 / tau. A = +1, tau_pos = 1: objective 2, loss -2; the gate's
    # slope at 1 is sigmoid'(0) * 4 = 1, so the gradient is -A = -1, the on-policy gradient of r * A.
    loss, grad, _ = one_token(-1.0, -1.0, 1.0, loss_type="sapo", sapo_temperature_pos=1.0)
    assert (loss, grad) == pytest.approx((-2.0, -1.0), abs=1e-12)
    # A = -1, tau_neg = 2: objective 2/2 * -1 = -1, loss 1; slope again 1, gradient +1
    loss, grad, _ = one_token(-1.0, -1.0, -1.0, loss_type="sapo", sapo_temperature_neg=2.0)
    assert (loss, grad) == pytest.approx((1.0, 1.0), abs=1e-12)
    # ratio e (far off-policy), A = +1, tau = 1: sigmoid(e - 1) * 4 = 3.3161, the gate nearly flat
    ratio = torch.tensor([[math.e]], dtype=F64)
    got = sapo_objective(ratio, torch.tensor([[1.0]], dtype=F64)).item()
    assert got == pytest.approx(4 / (1 + math.exp(-(math.e - 1))), abs=1e-12)


def test_luspo_hand_case():
    # Two rows on-policy (ratio 1), A = 1 each, of 1 and 3 tokens: per token -1. luspo sums each row (-1, -3) and
    # averages the rows: -2; grpo averages within the row first: -1. Each token's gradient under luspo is
    # -A / N = -0.5 whatever its row's length (under grpo the 3-token row's would be -1/6).
    x = torch.full((2, 3), -1.0, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    adv = torch.ones(2, dtype=F64)
    loss, _ = policy_loss(x, x.detach(), None, adv, mask, beta=0.0, loss_type="luspo")
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.item() == pytest.approx(-2.0, abs=1e-12)
    assert torch.equal(grad, -0.5 * mask)
    assert policy_loss(x, x.detach(), None, adv, mask, beta=0.0)[0].item() == pytest.approx(-1.0, abs=1e-12)


def test_vespo_hand_case():
    # One row of two tokens, log-ratios 0.25 + ln 2 - 0.25: the sequence's ratio w = 2. A = +1, k = 2, lambda = 3:
    # phi = e^3 * 2^2 * e^-6 = 4 e^-3 = 0.19915. The loss (dapo, 2 tokens) is -phi * A * (logp_1 + logp_2) / 2 =
    # -0.19915 * (-1 - 2) / 2 = 0.29872; the gradient is -phi / 2 on each token, phi detached.
    x = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = x.detach() - torch.tensor([[0.25, math.log(2) - 0.25]], dtype=F64)
    loss, stats = policy_loss(x, old, None, torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=F64), beta=0.0,
                              loss_type="vespo")
    (grad,) = torch.autograd.grad(loss, x)
    phi = 4 * math.exp(-3)
    assert loss.item() == pytest.approx(phi * 3 / 2, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-phi / 2, -phi / 2], abs=1e-12)
    assert stats["vespo_phi_mean"].item() == pytest.approx(phi, abs=1e-12)
    # w = 1 is the mode of phi for either sign: phi(1) = e^lam * 1 * e^-lam = 1
    w1 = vespo_weights(torch.zeros(2, 3, dtype=F64), torch.tensor([[1.0], [-1.0]], dtype=F64), torch.ones(2, 3))
    assert w1.tolist() == [[1.0], [1.0]]


def test_delta_hand_case():
    # A = -1 and ratio e = 2.718 above delta = 2: the unclipped branch is min(e, 2) * -1 = -2, the clipped one
    # 1.2 * -1 = -1.2; min is -2, so the loss is 2 and the gradient 0 (the cap holds). Without delta the loss is
    # e and the gradient e (the ratio's own derivative times -A).
    loss, grad, stats = one_token(0.0, -1.0, -1.0, delta=2.0)
    assert (loss, grad) == (2.0, 0.0) and stats["clip_fraction"].item() == 1.0
    loss, grad, stats = one_token(0.0, -1.0, -1.0)
    assert (loss, grad) == pytest.approx((math.e, math.e), abs=1e-12) and stats["clip_fraction"].item() == 0.0
    # A = +1 never reaches delta: 1 + eps_high holds the ratio first (loss -1.2 either way)
    assert one_token(0.0, -1.0, 1.0, delta=2.0)[:2] == pytest.approx((-1.2, 0.0), abs=1e-12)


def test_high_entropy_mask_hand_case():
    # Loss tokens' entropies 0.1 0.5 0.9 | 0.3 0.7 (padding holds 5.0 and 9.0). top 0.4: the 0.6 quantile of
    # the five, sorted 0.1 0.3 0.5 0.7 0.9, sits at position 0.6 * 4 = 2.4: 0.5 + 0.4 * (0.7 - 0.5) = 0.58;
    # kept: 0.9 and 0.7. Padding neither moves the quantile nor is kept.
    entropy = torch.tensor([[0.1, 0.5, 0.9, 5.0], [0.3, 0.7, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    keep = high_entropy_mask(entropy, mask, 0.4)
    assert keep.tolist() == [[False, False, True, False], [False, True, False, False]]
    assert high_entropy_mask(entropy, mask, 0.0).sum() == 1 and torch.equal(high_entropy_mask(entropy, mask, 1.0),
                                                                           mask.bool())
    with pytest.raises(ValueError, match=r"top_quantile must be in \[0, 1\]"):
        high_entropy_mask(entropy, mask, 1.5)


def test_high_entropy_mask_pooled_over_ranks_is_the_whole_batchs():
    # Two ranks each holding half the rows: with every rank's loss-token entropies pooled (TRL's gather), each
    # rank's mask is its rows of the mask the whole batch would get.
    case = make_case(7)
    whole = high_entropy_mask(case.entropy, case.mask, 0.3)
    pooled = case.entropy[case.mask.bool()]
    for rows in (slice(0, 3), slice(3, 6)):
        assert torch.equal(high_entropy_mask(case.entropy[rows], case.mask[rows], 0.3, pooled=pooled), whole[rows])
    assert not torch.equal(high_entropy_mask(case.entropy[:3], case.mask[:3], 0.3), whole[:3])  # unpooled differs


def test_off_policy_mask_hand_case():
    # Mean over the loss tokens of (sampler - current): row 0 (A = -1): (0.2 + 0.4) / 2 = 0.3 > 0.2: dropped;
    # row 1 (A = -1): 0.1 <= 0.2: kept; row 2 (A = +1): 0.9, kept (a positive advantage always is); row 3 (A = -1)
    # has no loss token: mean 0, kept; row 4 (A = 0, KL 0.9) is kept, as TRL keeps A >= 0. The padding's 100.0
    # never counts.
    current = torch.zeros(5, 3)
    sampler = torch.tensor([[0.2, 0.4, 100.0], [0.1, 0.1, 0.1], [0.9, 0.9, 0.9], [5.0, 5.0, 5.0], [0.9, 0.9, 0.9]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    keep = off_policy_mask(torch.tensor([-1.0, -1.0, 1.0, -1.0, 0.0]), current, sampler, mask, 0.2)
    assert keep.tolist() == [[False], [True], [True], [True], [True]]


def test_entropy_bonus_and_controller_hand_case():
    # bonus: mean over the masked tokens (1.0 + 2.0 + 3.0) / 3 = 2; the padding's inf counts for nothing
    entropy = torch.tensor([[1.0, 2.0], [3.0, math.inf]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert entropy_bonus(entropy, mask).item() == 2.0 and entropy_sums(entropy, mask).tolist() == [6.0, 3.0]
    # the controller, target 0.2, step 0.05 within [0, 0.12]: no bonus before a measurement (last = inf);
    # entropy 0.1 <= 0.2 raises the coefficient 0.1 -> 0.12 (capped) and turns the bonus on; 0.5 lowers it to 0.07
    # and turns it off for the next step.
    state, kw = AdaptiveEntropyState(0.1), dict(target=0.2, coef_delta=0.05, coef_min=0.0, coef_max=0.12)
    assert applied_entropy_coef(state, 0.2) == 0.0
    state = adaptive_entropy_step(state, (0.3, 3.0), **kw)
    assert (state.coef, state.last_entropy, applied_entropy_coef(state, 0.2)) == pytest.approx((0.12, 0.1, 0.12))
    state = adaptive_entropy_step(state, (1.0, 2.0), **kw)
    assert (state.coef, state.last_entropy, applied_entropy_coef(state, 0.2)) == pytest.approx((0.07, 0.5, 0.0))
    assert adaptive_entropy_step(state, (0.0, 0.0), **kw).last_entropy == 0.0  # no token: 0 / max(0, 1)


# ---------------------------------------------------------------- registries, defaults


def test_loss_types_pair_an_objective_with_an_aggregation():
    assert set(LOSS_TYPES) == {*LOSS_AGGREGATIONS, "cispo", "sapo", "luspo", "vespo"}
    assert {kind.objective for kind in LOSS_TYPES.values()} == set(POLICY_OBJECTIVES)
    assert all(LOSS_TYPES[name].aggregation is LOSS_AGGREGATIONS[name] for name in LOSS_AGGREGATIONS)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown loss_type 'gspo'; known: \['bnpo', 'dapo', 'dr_grpo', 'grpo'\] "
                                         r"\(the clipped surrogate\) and \['cispo', 'luspo', 'sapo', 'vespo'\]"):
        policy_loss(x, x, None, torch.zeros(2), torch.ones(2, 3), beta=0.0, loss_type="gspo")
    with pytest.raises(ValueError, match=r"loss_token_mask must be \[N, L\]=\(2, 3\) or \[N, 1\]"):
        policy_loss(x, x, None, torch.zeros(2), torch.ones(2, 3), beta=0.0, loss_token_mask=torch.ones(3))


def test_new_settings_default_to_trls():
    trl_defaults = {f.name: f.default for f in dataclasses.fields(TRLConfig)}
    ours = inspect.signature(policy_loss).parameters
    for name in ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                 "vespo_k_neg", "vespo_lambda_neg"):
        assert ours[name].default == trl_defaults[name], name
    assert inspect.signature(multi_reward_advantages).parameters["aggregation"].default == \
        trl_defaults["multi_objective_aggregation"]
    # off by default in TRL: no entropy mask, no off-policy mask, no bonus, no controller
    assert (trl_defaults["top_entropy_quantile"], trl_defaults["off_policy_mask_threshold"],
            trl_defaults["entropy_coef"], trl_defaults["use_adaptive_entropy"]) == (1.0, None, 0.0, False)


def frozen_inputs():
    gen = torch.Generator().manual_seed(1616)
    N, L = 6, 7
    logp = -torch.rand(N, L, generator=gen, dtype=F64) * 3
    old = logp + torch.randn(N, L, generator=gen, dtype=F64) * 0.3
    ref = logp + torch.randn(N, L, generator=gen, dtype=F64) * 0.5
    adv = torch.randn(N, generator=gen, dtype=F64)
    mask = ragged_mask(N, L, gen).double()
    weights = torch.rand(N, L, generator=gen, dtype=F64) + 0.5
    probe = torch.randn(N, L, generator=gen, dtype=F64)
    return logp, old, ref, adv, mask, weights, probe


# policy_loss before the new loss types (commit e03a2bf): (loss, sum of its gradient times a probe, then the stats in
# name order: clip_fraction clip_high clip_high_row_max clip_low clip_low_row_min clip_region clip_units kl
# ratio_max ratio_mean). "extra": sampler weights, kl_times_ratio, epsilon_high 0.28, a normalizer of 17.
FROZEN = {
    ("grpo", "token", False): (0.4105874855838962, -0.14684449153087314, 0.3076923076923077, 5.0, 0.42857142857142855, 3.0, 0.0, 8.0, 26.0, 0.21371849903680518, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("grpo", "token", True): (0.40229169047855934, -0.15646124645331724, 0.23076923076923078, 3.0, 0.3333333333333333, 3.0, 0.0, 6.0, 26.0, 0.19895487453132546, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("grpo", "sequence", False): (0.3765454186307909, -0.1489582219588984, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21371849903680518, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("grpo", "sequence", True): (0.34392982756639773, -0.14933367146355042, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21381795149222352, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("bnpo", "token", False): (0.1341987424941023, -0.06853136874767914, 0.3076923076923077, 5.0, 0.42857142857142855, 3.0, 0.0, 8.0, 26.0, 0.21371849903680518, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("bnpo", "token", True): (0.11178478819951937, -0.09494318740369097, 0.23076923076923078, 3.0, 0.3333333333333333, 3.0, 0.0, 6.0, 26.0, 0.19895487453132546, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("bnpo", "sequence", False): (0.11225343226972105, -0.10211699708905027, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21371849903680518, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("bnpo", "sequence", True): (0.07509316937400957, -0.10777254831492439, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21381795149222352, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("dr_grpo", "token", False): (0.08307541202015857, -0.042424180653325184, 0.3076923076923077, 5.0, 0.42857142857142855, 3.0, 0.0, 8.0, 26.0, 0.21371849903680518, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("dr_grpo", "token", True): (0.06920010698065485, -0.05877435410704674, 0.23076923076923078, 3.0, 0.3333333333333333, 3.0, 0.0, 6.0, 26.0, 0.19895487453132546, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("dr_grpo", "sequence", False): (0.06949021997649399, -0.06321528391226919, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21371849903680518, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("dr_grpo", "sequence", True): (0.04648624770772021, -0.06671633943304843, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21381795149222352, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("dapo", "token", False): (0.1341987424941023, -0.06853136874767914, 0.3076923076923077, 5.0, 0.42857142857142855, 3.0, 0.0, 8.0, 26.0, 0.21371849903680518, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("dapo", "token", True): (0.1709649701875002, -0.14520722779388023, 0.23076923076923078, 3.0, 0.3333333333333333, 3.0, 0.0, 6.0, 26.0, 0.19895487453132546, 1.5325573391162892, 1.0226083453296075),  # noqa: E501
    ("dapo", "sequence", False): (0.11225343226972105, -0.10211699708905027, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21371849903680518, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
    ("dapo", "sequence", True): (0.11484837668966169, -0.1648286033051785, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.21381795149222352, 1.0604382351628445, 0.9739694995851267),  # noqa: E501
}


@pytest.mark.parametrize("key", sorted(FROZEN))
def test_the_existing_loss_types_give_their_frozen_results(key):
    # The new keywords at their defaults leave the four loss types as they were (the same floats, up to the
    # last bits a different CPU's summation order could move).
    loss_type, level, extra = key
    logp, old, ref, adv, mask, weights, probe = frozen_inputs()
    logp.requires_grad_()
    kw = dict(sampler_weights=weights, kl_times_ratio=True, epsilon_high=0.28, normalizer=17.0) if extra else {}
    loss, stats = policy_loss(logp, old, ref, adv, mask, loss_type=loss_type, importance_sampling_level=level,
                              max_completion_length=7, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    got = (loss.item(), (grad * probe).sum().item(), *(stats[name].item() for name in sorted(stats)))
    assert got == pytest.approx(FROZEN[key], rel=1e-13, abs=1e-15)
