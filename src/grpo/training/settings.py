"""The config tree projected into the frozen settings records, in one place: what the rollout side reads
(``ExperienceSettings``, ``grpo.step.experience``), what the update reads (``LossSettings``,
``grpo.step.policy_update``), what the colocated mode's step source reads (``SamplingSettings``), the loop's
schedule, the evaluation's loss pass (``EvalLossSettings``), plus the sampling controls every log-prob pass follows
and how it runs (``logprob_pass``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo.algorithm import LogprobProcessing, advantage_estimator
from grpo.config import ConfigError, RunConfig
from grpo.config.device_defaults import pass_defaults
from grpo.config.rules import updates_per_step
from grpo.critic import CriticSettings
from grpo.models.moe import RouterLoss
from grpo.models.wrappers import eos_token_ids
from grpo.rollout import SamplingParams
from grpo.step.experience import ExperienceSettings, GaeSettings
from grpo.step.logprob_pass import LogprobPass
from grpo.step.update_inputs import LossSettings
from grpo.tasks import Task, run_system_prompt
from grpo.training.eval_loss import EvalLossSettings
from grpo.training.evaluator import eval_sources, primary_metric
from grpo.training.schedule import EPOCH, Schedule, epoch_steps, uses_epochs


def kl_in_reward(cfg: RunConfig) -> bool:
    """PPO's placement of the KL penalty: per token in the reward, not in the loss."""
    return cfg.algorithm.kl_penalty == "reward"


def logprob_processing(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> LogprobProcessing | None:
    """The sampling controls every log-prob pass must follow (rollout.repetition_penalty, min_new_tokens,
    min_p; min_new_tokens holds back the engines' EOS ids), or None when all are off."""
    r = cfg.rollout
    processing = LogprobProcessing(repetition_penalty=r.repetition_penalty, min_new_tokens=r.min_new_tokens,
                                   min_p=r.min_p, eos_ids=tuple(eos_token_ids(policy, tokenizer)))
    return processing if processing.active else None


def logprob_pass(cfg: RunConfig) -> LogprobPass:
    """How every log-prob pass runs (train.shared_prompt_pass, train.column_bucket; null: the device type's
    default, chosen where the pass runs: ``grpo.step.logprobs.pass_choices``)."""
    return LogprobPass(share_prompts=cfg.train.shared_prompt_pass, column_bucket=cfg.train.column_bucket,
                       fused_head=cfg.train.fused_lm_head, pack=cfg.train.pack_sequences)


def old_logprobs_after_sampling(cfg: RunConfig, *, decoupled_sampler: bool, engine_holds_weights: bool) -> bool:
    """The one rule for who computes ``old_logprobs``: True when the rollout side computes them right after
    sampling; False when the update takes them from its own first iteration (``train_on_batch``), where the
    weights are still the sampling policy's, at no extra pass.

    - The KL in the reward (PPO) needs them for the token rewards, before any update: always.
    - A decoupled sampler's weights may be stale, so the trainer cannot take them: the sampler does, unless
      the sampler correction is on and the engine reports its own log-probs (vLLM); those then travel as
      ``sampler_logprobs`` and the trainer takes old ones at the update's start.
    - Colocated, with the trainer's own model sampling: never needed after sampling (with several mini-batches
      the update takes the later ones' before its first update). With an engine that holds its own weights
      (vLLM) and more than one update per step (``updates_per_step``): after sampling (they also serve the
      off-policy guard); with one update its own pass is the old policy.
    """
    if kl_in_reward(cfg):
        return True
    if decoupled_sampler:
        return not (cfg.loss.sampler_is_correction and engine_holds_weights)
    return engine_holds_weights and updates_per_step(cfg) > 1


def experience_settings(cfg: RunConfig, processing: LogprobProcessing | None, *, task: Task,
                        decoupled_sampler: bool, engine_holds_weights: bool) -> ExperienceSettings:
    """The rollout-side settings from the config tree; old log-probs as ``old_logprobs_after_sampling`` rules.
    ``processing``: ``logprob_processing``'s (a required argument, so that no role can compute raw log-probs
    of processed samples by omission); ``task``: the run's (its system prompt)."""
    r = cfg.rollout
    gae = None
    if needs_critic(cfg):  # GAE over the critic's values
        gae = GaeSettings(gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                          kl_coef=cfg.loss.beta if kl_in_reward(cfg) else 0.0)
    return ExperienceSettings(
        sampling=SamplingParams(n=r.num_generations, max_tokens=r.max_completion_length,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                repetition_penalty=r.repetition_penalty, min_new_tokens=r.min_new_tokens,
                                min_p=r.min_p),
        system_prompt=run_system_prompt(cfg, task), max_prompt_length=cfg.data.max_prompt_length,
        advantage_estimator=cfg.algorithm.advantage_estimator, scale_rewards=cfg.loss.scale_rewards,
        advantage_eps=cfg.loss.advantage_eps, multi_objective_aggregation=cfg.algorithm.multi_objective_aggregation,
        need_old_logprobs=old_logprobs_after_sampling(cfg, decoupled_sampler=decoupled_sampler,
                                                      engine_holds_weights=engine_holds_weights),
        logprob_batch_size=cfg.train.micro_batch_size, max_steps=cfg.train.max_steps, gae=gae, processing=processing,
        logprob_pass=logprob_pass(cfg), routing_replay=cfg.loss.routing_replay)


def micro_batch_tokens(cfg: RunConfig, device_type: str) -> int | str | None:
    """``train.max_tokens_per_micro_batch`` as the update on a ``device_type`` device runs it. ``auto`` is fixed
    rows (None) under DeepSpeed, which steps after a fixed number of micro-batches, and where the device's
    defaults say so (CUDA: repeated shapes are reused, new ones cost more than the padding they save;
    ``grpo.config.device_defaults``); elsewhere it stays ``auto`` (``token_budget_micro_batches``)."""
    budget = cfg.train.max_tokens_per_micro_batch
    if budget == "auto" and (cfg.train.deepspeed or not pass_defaults(device_type).token_budget):
        return None
    return budget


def loss_settings(cfg: RunConfig, processing: LogprobProcessing | None, device_type: str,
                  router: RouterLoss | None = None) -> LossSettings:
    """The update-side settings from the config tree, for an update on a ``device_type`` device (the token
    budget); ``processing`` as ``experience_settings``; ``router``: the policy's load-balancing loss
    (``grpo.models.moe.router_loss`` of ``loss.router_aux_loss_coef``; None: none)."""
    return LossSettings(
        # With the KL in the reward, the loss has none (the reference log-probs still give the kl metric).
        epsilon=cfg.loss.epsilon, epsilon_high=cfg.loss.epsilon_high, beta=0.0 if kl_in_reward(cfg) else cfg.loss.beta,
        kl_times_ratio=cfg.loss.kl_times_ratio,
        loss_type=cfg.loss.loss_type, max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature, num_iterations=cfg.loss.num_iterations,
        micro_batch_size=cfg.train.micro_batch_size, max_grad_norm=cfg.optim.max_grad_norm,
        mini_batches=cfg.train.mini_batches, max_tokens_per_micro_batch=micro_batch_tokens(cfg, device_type),
        importance_sampling_level=cfg.loss.importance_sampling_level,
        mask_truncated_completions=cfg.loss.mask_truncated_completions,
        sampler_is_mode=cfg.loss.sampler_is_mode if cfg.loss.sampler_is_correction else None,
        sampler_is_cap=cfg.loss.sampler_is_cap, sampler_is_min=cfg.loss.sampler_is_min, processing=processing,
        ptx_coef=cfg.ptx.coef if cfg.ptx.data else 0.0, logprob_pass=logprob_pass(cfg),
        uneven_ranks=ranks_share_unevenly(cfg),
        # ZeRO-2/3 reduce in every backward: ranks with uneven shares run as many micro-batches as the most. FSDP2
        # gathers in every forward: its ranks always do (token budgets and dynamic sampling vary the count too).
        equal_micro_batches=ranks_share_unevenly(cfg) and bool(cfg.train.deepspeed) or cfg.train.fsdp,
        objective=objective_keywords(cfg), top_entropy_quantile=cfg.loss.top_entropy_quantile,
        off_policy_mask_threshold=cfg.loss.off_policy_mask_threshold, entropy_coef=cfg.loss.entropy_coef,
        adaptive_entropy=cfg.loss.adaptive_entropy, router=router, routing_replay=cfg.loss.routing_replay,
        routing_mismatch=cfg.log.routing_mismatch)


def objective_keywords(cfg: RunConfig) -> dict:
    """``policy_loss``'s keywords of the run's loss type beyond the clip range: delta and the sapo/vespo shapes."""
    loss = cfg.loss
    return {"delta": loss.delta, "sapo_temperature_pos": loss.sapo_temperature_pos,
            "sapo_temperature_neg": loss.sapo_temperature_neg, "vespo_k_pos": loss.vespo_k_pos,
            "vespo_lambda_pos": loss.vespo_lambda_pos, "vespo_k_neg": loss.vespo_k_neg,
            "vespo_lambda_neg": loss.vespo_lambda_neg}


def ranks_share_unevenly(cfg: RunConfig) -> bool:
    """Whether a step's trainer ranks may hold different shares of it: partial rollouts split a step's varying
    number of groups over them as evenly as whole groups allow."""
    return cfg.train.mode == "decoupled" and cfg.decoupled.partial_rollouts and cfg.decoupled.trainer_ranks > 1


def dynamic_rounds(cfg: RunConfig) -> int | None:
    """The cap on dynamic sampling's rounds (``rank_experience``'s ``max_rounds``); None when off."""
    return cfg.rollout.dynamic_sampling_max_rounds if cfg.rollout.dynamic_sampling else None


# Defined here rather than beside its reader (grpo.training.colocated.Sampling): that module imports this
# one's builders, and a record there would make the import circular.
@dataclass(frozen=True)
class SamplingSettings:
    """What the colocated mode's step source reads beyond the rollout step's own settings."""

    experience: ExperienceSettings
    seed: int  # train.seed: with the step and rank, the prompts and sampling seeds
    prompts_per_step: int
    max_rounds: int | None  # dynamic sampling's cap on rounds (None: off)
    check_steps: int  # rollout.vllm_check_steps: the off-policy guard's schedule (engines with their own weights)
    max_logprob_diff: float  # rollout.vllm_max_logprob_diff: the guard's bound
    sleep_mode: bool  # rollout.vllm_enable_sleep_mode: the engine sleeps through the update


def sampling_settings(cfg: RunConfig, experience: ExperienceSettings) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(experience=experience, seed=cfg.train.seed, prompts_per_step=cfg.train.prompts_per_step,
                            max_rounds=dynamic_rounds(cfg), check_steps=r.vllm_check_steps,
                            max_logprob_diff=r.vllm_max_logprob_diff, sleep_mode=r.vllm_enable_sleep_mode)


def loop_schedule(cfg: RunConfig, train_size: int = 0) -> Schedule:
    """When the loop checkpoints, evaluates, writes samples and stops; ``train_size``: data.train's prompts, which
    an epoch strategy counts epochs of (a ConfigError naming the strategy when they do not fill one step)."""
    t = cfg.train
    strategies = {"train.save_strategy": t.save_strategy, "train.eval_strategy": t.eval_strategy,
                  "log.logging_strategy": cfg.log.logging_strategy}
    per_epoch = None
    if uses_epochs(*strategies.values()):
        try:
            per_epoch = epoch_steps(train_size, t.prompts_per_step)
        except ValueError as err:
            key = next(key for key, value in strategies.items() if value == EPOCH)
            raise ConfigError(f"{key} is epoch: {err}") from None
    return Schedule(max_steps=t.max_steps, save_steps=t.save_steps, eval_steps=t.eval_steps,
                    eval_on_start=t.eval_on_start, eval_at_end=t.eval_at_end,
                    logging_steps=cfg.log.logging_steps, num_samples=cfg.log.num_samples,
                    early_stop_accuracy=t.early_stop_accuracy,
                    early_stop_metric=primary_metric(eval_sources(cfg.data.eval)),
                    max_skipped_steps=cfg.optim.max_skipped_steps, updates_per_step=updates_per_step(cfg),
                    save_final=t.save_final, plots=cfg.log.plots, save_strategy=t.save_strategy,
                    eval_strategy=t.eval_strategy, logging_strategy=cfg.log.logging_strategy,
                    steps_per_epoch=per_epoch, load_best_at_end=t.load_best_at_end)


def needs_critic(cfg: RunConfig) -> bool:
    """The run's advantage estimator trains a critic beside the policy (gae: PPO)."""
    return advantage_estimator(cfg.algorithm.advantage_estimator).needs_critic


def critic_settings(cfg: RunConfig) -> CriticSettings:
    """PPO's critic update: the same micro-batches, mini-batches and number of passes as the policy's."""
    return CriticSettings(value_clip=cfg.loss.value_clip, micro_batch_size=cfg.train.micro_batch_size,
                          num_iterations=cfg.loss.num_iterations, mini_batches=cfg.train.mini_batches)


def eval_loss_settings(cfg: RunConfig, task: Task, processing, device_type: str,
                       router: RouterLoss | None = None) -> EvalLossSettings:
    """``eval.loss_pass``'s settings for a run with ``task`` on a ``device_type`` device (``processing``:
    ``logprob_processing``'s, as every log-prob pass follows it): ``eval.num_generations`` completions per prompt;
    ``router`` as ``loss_settings``."""
    experience = experience_settings(cfg, processing, task=task, decoupled_sampler=False, engine_holds_weights=False)
    sampling = replace(experience.sampling, n=cfg.eval.num_generations or cfg.rollout.num_generations)
    return EvalLossSettings(replace(experience, need_old_logprobs=False, sampling=sampling),
                            replace(loss_settings(cfg, processing, device_type, router), num_iterations=1, mini_batches=1,
                                    ptx_coef=0.0),
                            cfg.eval.loss_batch_size, cfg.train.seed)
