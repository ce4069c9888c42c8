"""The colocated mode: one process (or N data-parallel ranks) samples, scores and learns.

Each step this rank samples its prompts' groups (``grpo.step.experience.rank_experience``: generate,
rewards, dynamic sampling's extra rounds, advantages, old/ref log-probs), then the shared loop
(``grpo.training.loop``) updates, logs and checkpoints. What is particular to this mode: the engine
that samples (its weights pushed after each update when it holds its own copy, vLLM) and the off-policy
guard on that engine's log-probs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from grpo.config import RunConfig
from grpo.critic import build_critic, generation_values
from grpo.data.prompt_sampler import PromptSampler
from grpo.models.loading import check_memory_savers, compute_context, load_reference
from grpo.multiturn.driver import sampling_engine
from grpo.multiturn.wiring import with_turns
from grpo.rollout.build import build_engine, check_engine_available, holds_own_weights, push_policy_weights
from grpo.rollout.offpolicy_guard import check_sampler_logprobs, is_check_step
from grpo.run.best import BestMetric
from grpo.run.progress import StepProgress
from grpo.run.run_dir import check_output_dir
from grpo.step.experience import ExperienceSettings, generation_logprobs, local_reference, rank_experience
from grpo.parallel.distributed import shutdown
from grpo.tasks import run_task
from grpo.training.evaluator import primary_result, run_evaluator
from grpo.training.loop import Collected, Loop, PolicyUpdate, run_loop
from grpo.training.settings import (critic_settings, dynamic_rounds, experience_settings, logprob_pass,
                                    logprob_processing, loop_schedule, loss_settings, needs_critic)
from grpo.training.inputs import GivenInputs, policy_for, tokenizer_and_data
from grpo.parallel.trainable import build_trainable
from grpo.training.prepare import load_ptx_data, open_run, start_process


@dataclass
class TrainResult:
    output_dir: Path
    last_step: int
    eval_before: dict | None  # the first eval set's metrics before training (accuracy, format_rate, ...)
    eval_after: dict | None  # and after


@dataclass
class Sampling:
    """How the colocated loop gets a step's batch: this rank's prompts, sampled by its engine and scored
    (a ``grpo.training.loop.StepSource``)."""

    cfg: RunConfig
    engine: object
    policy: torch.nn.Module
    ref_logprobs: object
    tokenizer: object
    train_set: list
    prompt_sampler: PromptSampler
    reward_fns: list
    reward_weights: list[float]
    settings: ExperienceSettings
    info: object
    values_fn: object = None
    processing: object = None
    start_step: int = 0

    def __post_init__(self) -> None:
        self.base_engine = sampling_engine(self.engine)  # what samples, under any tools/hook wrapper
        self.own_weights = holds_own_weights(self.base_engine)  # vLLM: a copy to keep in step with the policy
        self.check_every = self.cfg.rollout.vllm_check_steps if self.own_weights else 0
        self.sleeps = self.own_weights and self.cfg.rollout.vllm_enable_sleep_mode

    def collect(self, step: int, stop_requested=None) -> Collected:  # sampling here ends on its own
        started = time.perf_counter()
        batch, rollout_stats = rank_experience(
            self.engine, self.policy, self.ref_logprobs, self.tokenizer, self.train_set, self.prompt_sampler,
            self.reward_fns, self.reward_weights, self.settings, step=step, rank=self.info.rank,
            world_size=self.info.world_size, seed=self.cfg.train.seed, max_rounds=dynamic_rounds(self.cfg),
            values_fn=self.values_fn)
        checked = {}  # the off-policy guard: free with old log-probs, else on its schedule
        if self.check_every and (batch.old_logprobs is not None
                                 or is_check_step(step, self.check_every, self.start_step + 1)):
            checked = self.offpolicy_check(batch, step)
        rollout_s = time.perf_counter() - started
        if self.sleeps:
            self.base_engine.sleep()  # its GPU memory goes to the update
        return Collected(batch, rollout_s, rollout_stats, checked)

    def offpolicy_check(self, batch, step: int) -> dict[str, float]:
        """The off-policy guard (``grpo.rollout.offpolicy_guard``) on this step's batch, before its update:
        the engine's log-probs against the trainer's (one no-grad pass for them when there are no old
        log-probs, hence on a schedule then)."""
        trainer_logprobs = batch.old_logprobs
        if trainer_logprobs is None:
            trainer_logprobs = generation_logprobs(self.policy, batch.generation, self.cfg.rollout.temperature,
                                                   self.cfg.train.micro_batch_size, self.processing,
                                                   logprob_pass(self.cfg))
        return check_sampler_logprobs(step, batch.sampler_logprobs, trainer_logprobs,
                                      batch.generation.sampled_mask, self.cfg.rollout.vllm_max_logprob_diff,
                                      self.info)

    def after_update(self, step: int, collected: Collected, checkpointing: bool) -> dict[str, float]:
        metrics = {"epoch": self.prompt_sampler.epoch_of(step)}
        if self.own_weights:  # the engine's weight copy becomes the policy's
            started = time.perf_counter()
            if self.sleeps:
                self.base_engine.wake_up()
            push_policy_weights(self.base_engine, self.policy, step)
            metrics["time/weight_sync_s"] = time.perf_counter() - started
        return metrics

    def checkpoint_state(self, step: int, collected: Collected | None) -> dict:
        return {"prompts_consumed": step * self.cfg.train.prompts_per_step}

    def checkpoint_written(self, step: int, collected: Collected | None) -> None:
        pass


def train(cfg: RunConfig, given: GivenInputs | None = None) -> TrainResult:
    """Run GRPO as configured (with ``given``'s objects in place of what the config names: the Python API's
    model, data and rewards); returns where the run went and its before/after evaluation."""
    given = given or GivenInputs()
    info, device = start_process(cfg)
    failed = None
    try:
        if info.is_main:
            check_output_dir(cfg)
        torch.manual_seed(cfg.train.seed)
        inputs = tokenizer_and_data(cfg, given)
        tokenizer, train_set, eval_sets = inputs.tokenizer, inputs.train_set, inputs.eval_sets
        reward_fns, reward_weights = inputs.reward_fns, inputs.reward_weights
        ptx_data = load_ptx_data(cfg, tokenizer, info)  # PTX pairs (ptx.data), or None
        prompt_sampler = PromptSampler(len(train_set), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
        prompt_sampler.rank_indices(1, info.rank, info.world_size)  # checks P is divisible by the ranks, early
        check_memory_savers(cfg.model, cfg.optim.optimizer, device)
        check_engine_available(cfg)
        deepspeed = bool(cfg.train.deepspeed)
        policy = policy_for(cfg, given, device, deepspeed)
        compute = compute_context(cfg.model, device, deepspeed)  # bf16 autocast over fp32 master weights
        reference = load_reference(cfg.model, policy, tokenizer, device) if cfg.loss.beta > 0 else None
        processing = logprob_processing(cfg, policy, tokenizer)  # every log-prob pass follows the sampling controls
        ref_logprobs = (local_reference(policy, reference, cfg.rollout.temperature, cfg.train.micro_batch_size,
                                        processing, logprob_pass(cfg)) if cfg.loss.beta > 0 else None)
        trainable = build_trainable(cfg, policy, info)
        critic = build_critic(cfg, info, device) if needs_critic(cfg) else None
        run = open_run(cfg, trainable, info, critic)
        eval_before = run.resumed_state.get("eval_before") if run.resumed_state else None

        base_engine = build_engine(cfg, policy, tokenizer)
        engine = with_turns(base_engine, inputs.turns, cfg, policy, tokenizer)
        if holds_own_weights(base_engine) and run.start_step > 0:
            push_policy_weights(base_engine, policy, run.start_step)
        exp_settings = experience_settings(cfg, processing, decoupled_sampler=False,
                                           engine_holds_weights=holds_own_weights(base_engine))
        # PPO: the critic's values after sampling, and its own update after the policy's.
        values_fn = partial(generation_values, critic.model, batch_size=cfg.train.micro_batch_size) if critic else None
        sampling = Sampling(cfg, engine, policy, ref_logprobs, tokenizer, train_set, prompt_sampler, reward_fns,
                            reward_weights, exp_settings, info, values_fn, processing, run.start_step)
        update = PolicyUpdate(trainable, loss_settings(cfg, processing), info, ptx_data, critic, critic_settings(cfg))
        evaluate = run_evaluator(cfg, inputs, engine, base_engine, policy, info, run.out) if eval_sets else None
        best = (BestMetric.resumed(run.out, cfg.train.best_metric, cfg.train.best_metric_mode)
                if cfg.train.best_metric and evaluate is not None else None)
        loop = Loop(loop_schedule(cfg), update, trainable, tokenizer, run.out, info, run.logger,
                    StepProgress(cfg.train.max_steps, run.start_step, enabled=info.is_main and cfg.log.progress_bar),
                    compute, cfg.rollout.num_generations, cfg.data.tag_style, cfg.train.save_total_limit,
                    evaluate=evaluate, best=best, critic=critic, hooks=inputs.hooks, score=run_task(cfg).score,
                    layout=run.layout)
        result = run_loop(loop, sampling, run.start_step, eval_before)
        return TrainResult(run.out, result.last_step, primary_result(result.eval_before),
                           primary_result(result.eval_after))
    except BaseException as err:
        failed = err
        raise
    finally:
        shutdown(info, failed)
