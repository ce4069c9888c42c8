"""The config tree projected into the step's frozen settings records, in one place: what the rollout
side reads (``ExperienceSettings``, ``grpo.step.experience``) and what the update reads (``LossSettings``,
``grpo.step.policy_update``), plus the sampling controls every log-prob pass follows."""

from __future__ import annotations

import torch

from grpo.algorithm import LogprobProcessing
from grpo.config import RunConfig
from grpo.data import resolve_system_prompt
from grpo.models.wrappers import eos_token_ids
from grpo.rollout import SamplingParams
from grpo.step.experience import ExperienceSettings, GaeSettings
from grpo.step.policy_update import LossSettings


def kl_in_reward(cfg: RunConfig) -> bool:
    """PPO's placement of the KL penalty: per token in the reward, not in the loss."""
    return cfg.algorithm.kl_penalty == "reward"


def logprob_processing(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> LogprobProcessing | None:
    """The sampling controls every log-prob pass must follow (rollout.repetition_penalty, min_new_tokens,
    min_p; min_new_tokens holds back the engines' EOS ids), or None when all are off (today's path)."""
    r = cfg.rollout
    processing = LogprobProcessing(repetition_penalty=r.repetition_penalty, min_new_tokens=r.min_new_tokens,
                                   min_p=r.min_p, eos_ids=tuple(eos_token_ids(policy, tokenizer)))
    return processing if processing.active else None


def experience_settings(cfg: RunConfig, processing: LogprobProcessing | None,
                        need_old_logprobs: bool | None = None) -> ExperienceSettings:
    """The rollout-side settings from the config tree (old log-probs when num_iterations > 1, unless told;
    always when the KL penalty is in the reward, which needs them). ``processing``: ``logprob_processing``'s
    (a required argument, so that no role can compute raw log-probs of processed samples by omission)."""
    r = cfg.rollout
    gae = None
    if cfg.algorithm.advantage_estimator == "gae":
        gae = GaeSettings(gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                          kl_coef=cfg.loss.beta if kl_in_reward(cfg) else 0.0)
    need_old_logprobs = cfg.loss.num_iterations > 1 if need_old_logprobs is None else need_old_logprobs
    return ExperienceSettings(
        sampling=SamplingParams(n=r.num_generations, max_tokens=r.max_completion_length,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                repetition_penalty=r.repetition_penalty, min_new_tokens=r.min_new_tokens,
                                min_p=r.min_p),
        system_prompt=resolve_system_prompt(cfg.data.system_prompt, cfg.data.tag_style),
        tag_style=cfg.data.tag_style, max_prompt_length=cfg.data.max_prompt_length,
        advantage_estimator=cfg.algorithm.advantage_estimator, scale_rewards=cfg.loss.scale_rewards,
        advantage_eps=cfg.loss.advantage_eps,
        need_old_logprobs=need_old_logprobs or kl_in_reward(cfg),
        logprob_batch_size=cfg.train.micro_batch_size, max_steps=cfg.train.max_steps, gae=gae, processing=processing)


def loss_settings(cfg: RunConfig, processing: LogprobProcessing | None) -> LossSettings:
    """The update-side settings from the config tree; ``processing`` as ``experience_settings``."""
    return LossSettings(
        # With the KL in the reward, the loss has none (the reference log-probs still give the kl metric).
        epsilon=cfg.loss.epsilon, epsilon_high=cfg.loss.epsilon_high, beta=0.0 if kl_in_reward(cfg) else cfg.loss.beta,
        loss_type=cfg.loss.loss_type, max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature, num_iterations=cfg.loss.num_iterations,
        micro_batch_size=cfg.train.micro_batch_size, max_grad_norm=cfg.optim.max_grad_norm,
        importance_sampling_level=cfg.loss.importance_sampling_level,
        mask_truncated_completions=cfg.loss.mask_truncated_completions,
        sampler_is_mode=cfg.loss.sampler_is_mode if cfg.loss.sampler_is_correction else None,
        sampler_is_cap=cfg.loss.sampler_is_cap, sampler_is_min=cfg.loss.sampler_is_min, processing=processing,
        ptx_coef=cfg.ptx.coef if cfg.ptx.data else 0.0)


def dynamic_rounds(cfg: RunConfig) -> int | None:
    """The cap on dynamic sampling's rounds (``grpo.step.experience.rank_experience``'s ``max_rounds``); None when off."""
    return cfg.rollout.dynamic_sampling_max_rounds if cfg.rollout.dynamic_sampling else None
