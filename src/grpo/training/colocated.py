"""The colocated mode: one process (or N data-parallel ranks) samples, scores and learns.

Each step this rank samples its prompts' groups (``grpo.step.experience.rank_experience``: generate,
rewards, dynamic sampling's extra rounds, advantages, old/ref log-probs), then the shared loop
(``grpo.training.loop``) updates, logs and checkpoints. What is particular to this mode: the engine
that samples (its weights pushed after each update when it holds its own copy, vLLM) and the off-policy
guard on that engine's log-probs.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from grpo.config import RunConfig
from grpo.critic import generation_values
from grpo.data.prompt_sampler import PromptSampler
from grpo.multiturn.driver import sampling_engine
from grpo.multiturn.wiring import with_turns
from grpo.parallel.distributed import DistInfo, shutdown
from grpo.rollout.build import build_engine, check_engine_available, holds_own_weights, push_policy_weights
from grpo.rollout.offpolicy_guard import check_sampler_logprobs, is_check_step
from grpo.run.progress import StepProgress
from grpo.step.experience import RefLogprobs, Values, generation_logprobs, rank_experience
from grpo.training.evaluator import primary_result
from grpo.training.inputs import GivenInputs
from grpo.training.loop import Collected, run_loop
from grpo.training.prepare import Prepared, build_evaluator, make_loop, prepare, start_process
from grpo.training.settings import SamplingSettings, experience_settings, sampling_settings


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

    settings: SamplingSettings
    engine: object
    policy: torch.nn.Module
    ref_logprobs: RefLogprobs | None
    tokenizer: object
    train_set: list
    prompt_sampler: PromptSampler
    reward_fns: list
    reward_weights: list[float]
    info: DistInfo
    values_fn: Values | None = None  # PPO: the critic's values of the sampled states
    start_step: int = 0
    # FSDP2: sampling and its log-prob passes run on the gathered policy (and reference): ranks stop at EOS and
    # run dynamic sampling's rounds each by its own prompts, and without collectives nothing waits on that
    gathered: Callable[[], AbstractContextManager] = nullcontext

    def __post_init__(self) -> None:
        self.base_engine = sampling_engine(self.engine)  # what samples, under any tools/hook wrapper
        self.own_weights = holds_own_weights(self.base_engine)  # vLLM: a copy to keep in step with the policy
        self.check_every = self.settings.check_steps if self.own_weights else 0
        self.sleeps = self.own_weights and self.settings.sleep_mode

    def collect(self, step: int, stop_requested=None) -> Collected:  # sampling here ends on its own
        started = time.perf_counter()
        s = self.settings
        with self.gathered():
            batch, rollout_stats = rank_experience(
                self.engine, self.policy, self.ref_logprobs, self.tokenizer, self.train_set, self.prompt_sampler,
                self.reward_fns, self.reward_weights, s.experience, step=step, rank=self.info.rank,
                world_size=self.info.world_size, seed=s.seed, max_rounds=s.max_rounds, values_fn=self.values_fn)
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
            e = self.settings.experience  # the passes that take old log-probs after sampling
            trainer_logprobs = generation_logprobs(self.policy, batch.generation, e.sampling.temperature,
                                                   e.logprob_batch_size, e.processing, e.logprob_pass)
        return check_sampler_logprobs(step, batch.sampler_logprobs, trainer_logprobs,
                                      batch.generation.sampled_mask, self.settings.max_logprob_diff, self.info)

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
        return {"prompts_consumed": step * self.settings.prompts_per_step}

    def checkpoint_written(self, step: int, collected: Collected | None) -> None:
        pass


def sampling(cfg: RunConfig, prepared: Prepared, engine) -> Sampling:
    """This rank's step source over ``prepared``'s inputs, sampling with ``engine`` (PPO: the critic's values
    after sampling, its own update after the policy's)."""
    p, inputs = prepared, prepared.inputs
    experience = experience_settings(cfg, p.processing, task=inputs.task, decoupled_sampler=False,
                                     engine_holds_weights=holds_own_weights(sampling_engine(engine)))
    values_fn = (partial(generation_values, p.critic.model, batch_size=cfg.train.micro_batch_size)
                 if p.critic else None)
    return Sampling(sampling_settings(cfg, experience), engine, p.policy, p.ref_logprobs, inputs.tokenizer,
                    inputs.train_set, p.prompt_sampler, inputs.reward_fns, inputs.reward_weights, p.info, values_fn,
                    p.run.start_step, p.gathered)


def train(cfg: RunConfig, given: GivenInputs | None = None) -> TrainResult:
    """Run GRPO as configured (with ``given``'s objects in place of what the config names: the Python API's
    model, data and rewards); returns where the run went and its before/after evaluation."""
    info, device = start_process(cfg)
    failed = None
    try:
        check_engine_available(cfg)  # a missing vLLM fails before anything loads
        p = prepare(cfg, given or GivenInputs(), info, device, samples=True)
        base_engine = build_engine(cfg, p.policy, p.inputs.tokenizer)
        engine = with_turns(base_engine, p.inputs.turns, cfg, p.policy, p.inputs.tokenizer)
        if holds_own_weights(base_engine) and p.run.start_step > 0:
            push_policy_weights(base_engine, p.policy, p.run.start_step)
        evaluate = build_evaluator(cfg, p.inputs, p.policy, info, p.run.out, engine, base_engine,
                                   p.ref_logprobs)
        progress = StepProgress(cfg.train.max_steps, p.run.start_step, enabled=info.is_main and cfg.log.progress_bar)
        result = run_loop(make_loop(cfg, p, progress, evaluate), sampling(cfg, p, engine), p.run.start_step,
                          p.run.eval_before)
        return TrainResult(p.run.out, result.last_step, primary_result(result.eval_before),
                           primary_result(result.eval_after))
    except BaseException as err:
        failed = err
        raise
    finally:
        shutdown(info, failed)
