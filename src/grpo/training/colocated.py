"""The colocated GRPO loop: one process (or N data-parallel ranks) samples, scores and learns.

Each step: this rank's prompts (``PromptSampler``) -> ``rank_experience`` (generate, rewards, with
dynamic sampling more rounds until the batch is full, advantages, old/ref log-probs) ->
``train_on_batch`` (clipped surrogate, + the PTX loss of the step's SFT pairs with ``ptx.data``, AdamW)
-> metrics, samples, checkpoints, evaluation. Setup pieces shared with the decoupled roles are in
``run_setup``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from grpo.config import RunConfig, config_to_dict
from grpo.critic import CriticSettings, build_critic, generation_values, train_critic
from grpo.data.prompt_sampler import PromptSampler
from grpo.models.loading import (
    check_memory_savers,
    compute_context,
    load_policy,
    load_reference,
    load_tokenizer,
    uses_autocast,
)
from grpo.rollout.build import build_engine, check_engine_available, holds_own_weights, push_policy_weights
from grpo.rollout.offpolicy_guard import check_sampler_logprobs, is_check_step
from grpo.run.resume import resume_checkpoint, save_run_checkpoint
from grpo.run.run_dir import check_output_dir, claim_output_dir
from grpo.step.experience import generation_logprobs, local_reference, rank_experience
from grpo.step.metrics import sample_records, step_metrics
from grpo.step.policy_update import train_on_batch
from grpo.training.distributed import barrier, print0, shutdown
from grpo.training.evaluation import eval_metrics, run_eval
from grpo.training.guards import DeferredInterrupt, SkipGuard
from grpo.training.settings import dynamic_rounds, experience_settings, logprob_processing, loss_settings
from grpo.training.setup import build_rewards, build_trainable, load_data, load_ptx_data, start_process


@dataclass
class TrainResult:
    output_dir: Path
    last_step: int
    eval_before: dict | None
    eval_after: dict | None


def sync_engine(engine, policy, step: int, sleeps: bool) -> dict[str, float]:
    """After step ``step``'s update: the engine's weight copy becomes the policy's (waking it first
    when it slept through the update). Returns the sync time."""
    started = time.perf_counter()
    if sleeps:
        engine.wake_up()
    push_policy_weights(engine, policy, step)
    return {"time/weight_sync_s": time.perf_counter() - started}


def check_engine(cfg: RunConfig, policy, batch, step: int, info, processing=None) -> dict[str, float]:
    """The off-policy guard (``grpo.rollout.offpolicy_guard``) on this step's batch, before its update: the
    engine's log-probs (``batch.sampler_logprobs``, every round's with dynamic sampling) against the
    trainer's. With ``loss.num_iterations`` 1 the trainer has no old log-probs, so a checked step pays one
    no-grad forward pass for them (hence every N steps, not every step); with more iterations they exist
    already and every step is checked. ``processing``: the sampling controls
    (``run_setup.logprob_processing``), which vLLM's processed log-probs include too."""
    trainer_logprobs = batch.old_logprobs
    if trainer_logprobs is None:
        trainer_logprobs = generation_logprobs(policy, batch.generation, cfg.rollout.temperature,
                                               cfg.train.micro_batch_size, processing)
    return check_sampler_logprobs(step, batch.sampler_logprobs, trainer_logprobs, batch.generation.completion_mask,
                                  cfg.rollout.vllm_max_logprob_diff, info)


def train(cfg: RunConfig) -> TrainResult:
    """Run GRPO as configured; returns where the run went and its before/after evaluation."""
    from grpo.run.checkpoint import save_final
    from grpo.run.plots import plot_run
    from grpo.run.progress import StepProgress
    from grpo.run.tracking import MetricsLogger
    from grpo.training.learners import zero3_full_state_dict

    info, device = start_process(cfg)
    try:
        out = check_output_dir(cfg) if info.is_main else None
        torch.manual_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
        train_set, eval_set = load_data(cfg)
        ptx_data = load_ptx_data(cfg, tokenizer, info)  # PTX pairs (ptx.data), or None
        reward_fns, weights = build_rewards(cfg, train_set)  # a broken reward stops the run before any model loads
        sampler = PromptSampler(len(train_set), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
        sampler.rank_indices(1, info.rank, info.world_size)  # checks P is divisible by the ranks, early
        check_memory_savers(cfg.model, cfg.optim.optimizer, device)
        check_engine_available(cfg)
        deepspeed = bool(cfg.train.deepspeed)
        policy = load_policy(cfg.model, device, master_weights=uses_autocast(cfg.model, deepspeed))
        compute = compute_context(cfg.model, device, deepspeed)  # bf16 autocast over fp32 master weights
        reference = load_reference(cfg.model, policy, tokenizer, device) if cfg.loss.beta > 0 else None
        processing = logprob_processing(cfg, policy, tokenizer)  # every log-prob pass follows the sampling controls
        ref_logprobs = (local_reference(policy, reference, cfg.rollout.temperature, cfg.train.micro_batch_size,
                                        processing) if cfg.loss.beta > 0 else None)
        trainable = build_trainable(cfg, policy, info)
        critic = build_critic(cfg, info, device) if cfg.algorithm.advantage_estimator == "gae" else None
        out = claim_output_dir(cfg, info.is_main)  # setup succeeded: only now is anything written
        barrier(info)

        start_step, eval_before = 0, None
        resumed = resume_checkpoint(out, trainable, info, critic) if cfg.train.resume else None
        if resumed is not None:
            checkpoint, state = resumed
            start_step, eval_before = state["step"], state.get("eval_before")
            print0(info, f"resumed from {checkpoint} (step {start_step})")
        engine = build_engine(cfg, policy, tokenizer)
        own_weights = holds_own_weights(engine)  # vLLM: a copy to keep in step with the policy
        if own_weights and start_step > 0:
            push_policy_weights(engine, policy, start_step)
        # Old log-probs come from the first iteration of the update (train_on_batch), not a separate pass;
        # with vLLM and num_iterations > 1 they are computed after sampling, and serve the guard too.
        exp_settings = experience_settings(cfg, processing,
                                           need_old_logprobs=own_weights and cfg.loss.num_iterations > 1)
        check_every = cfg.rollout.vllm_check_steps if own_weights else 0
        first_step = start_step + 1  # this process's first step (the guard checks it and the next)
        train_settings = loss_settings(cfg, processing)
        values_fn = None
        if critic is not None:  # PPO: the critic's values after sampling, and its own update after the policy's
            values_fn = partial(generation_values, critic.model, batch_size=cfg.train.micro_batch_size)
            critic_settings = CriticSettings(value_clip=cfg.loss.value_clip, micro_batch_size=cfg.train.micro_batch_size,
                                             num_iterations=cfg.loss.num_iterations)
        # A resume that found no checkpoint starts over, and so do its metrics (resume_step 0 would keep the
        # killed run's step-0 evaluation and log it a second time).
        logger = MetricsLogger(out, cfg.log.report_to, config_to_dict(cfg), enabled=info.is_main,
                               resume_step=start_step if resumed is not None else None,
                               wandb_project=cfg.log.wandb_project)

        if start_step == 0 and eval_set:
            with compute:
                eval_before = run_eval(cfg, policy, tokenizer, eval_set, info)
            logger.log(0, eval_metrics(eval_before))
        step, skips = start_step, SkipGuard(cfg.optim.max_skipped_steps, cfg.loss.num_iterations)
        progress = StepProgress(cfg.train.max_steps, start_step, enabled=info.is_main and cfg.log.progress_bar)

        # The weights are those of step `done` except while a step's update runs (`updating`); `saved` is
        # the newest checkpoint's step.
        done = saved = start_step
        updating = False
        interrupt = DeferredInterrupt()

        def checkpoint_now(at_step: int) -> None:
            nonlocal saved
            state = {"step": at_step, "prompts_consumed": at_step * cfg.train.prompts_per_step,
                     "eval_before": eval_before}
            save_run_checkpoint(out, at_step, trainable, tokenizer, state, cfg, info, critic)
            saved = at_step

        try:
            with progress, compute:
                for step in range(start_step + 1, cfg.train.max_steps + 1):
                    started = time.perf_counter()
                    batch, sampled = rank_experience(
                        engine, policy, ref_logprobs, tokenizer, train_set, sampler, reward_fns, weights, exp_settings,
                        step=step, rank=info.rank, world_size=info.world_size, seed=cfg.train.seed,
                        max_rounds=dynamic_rounds(cfg), values_fn=values_fn)
                    checked = {}  # the off-policy guard, free with old log-probs, else on its schedule
                    if check_every and (batch.old_logprobs is not None
                                        or is_check_step(step, check_every, first_step)):
                        checked = check_engine(cfg, policy, batch, step, info, processing)
                    rollout_done = time.perf_counter()
                    if own_weights and cfg.rollout.vllm_enable_sleep_mode:
                        engine.sleep()  # its GPU memory goes to the update
                    # From the update to the step's checkpoint, Ctrl-C waits for the step to end (see
                    # DeferredInterrupt): the weights then match the step that is logged and saved.
                    with interrupt.holding():
                        updating = True
                        ptx_batch = ptx_data.batch(step, info.rank) if ptx_data else None
                        train_stats = train_on_batch(trainable.learner, batch, train_settings, info, ptx_batch)
                        if critic is not None:
                            train_stats.update(train_critic(critic.learner, batch, critic_settings))
                        trained = time.perf_counter()
                        metrics = step_metrics(batch, train_stats, cfg.rollout.num_generations, cfg.data.tag_style,
                                               started, rollout_done - started, trained - rollout_done, info, sampled)
                        metrics.update(checked)
                        if own_weights:
                            metrics.update(sync_engine(engine, policy, step, cfg.rollout.vllm_enable_sleep_mode))
                        metrics["epoch"] = sampler.epoch_of(step)
                        if cfg.train.eval_steps and step % cfg.train.eval_steps == 0 and step < cfg.train.max_steps:
                            metrics.update(eval_metrics(run_eval(cfg, policy, tokenizer, eval_set, info)))
                        logger.log(step, metrics)
                        if cfg.log.num_samples and step % cfg.log.logging_steps == 0:
                            logger.log_samples(step, sample_records(batch, cfg.log.num_samples))
                        updating, done = False, step
                        progress.update(step, metrics)
                        if step % cfg.train.save_steps == 0 or step == cfg.train.max_steps:
                            checkpoint_now(step)
                    skips.record(step, train_stats)
                    target = cfg.train.early_stop_accuracy
                    if target is not None and metrics.get("eval/accuracy", -1.0) >= target:
                        print0(info, f"eval/accuracy {metrics['eval/accuracy']:.3f} reached {target}: stopping")
                        if step % cfg.train.save_steps != 0:
                            checkpoint_now(step)
                        break
        except KeyboardInterrupt:
            # The step in flight when the interrupt came is lost, never saved under another step's number
            # (its batch would then be trained twice after resuming).
            if updating or interrupt.forced:
                print0(info, f"\ninterrupted during the update of step {done + 1}: nothing saved; --resume "
                             f"continues from step {saved}")
            elif done > saved:
                print0(info, f"\ninterrupted: saving a checkpoint of step {done}")
                checkpoint_now(done)
            logger.close()
            raise

        with compute:
            eval_after = run_eval(cfg, policy, tokenizer, eval_set, info)
        if eval_after is not None:
            logger.log(step, eval_metrics(eval_after))
        logger.close()
        final_weights = zero3_full_state_dict(trainable.learner)
        if info.is_main:
            save_final(out, policy, tokenizer, state_dict=final_weights)
            plot_run(out)
        barrier(info)
        return TrainResult(out, step, eval_before, eval_after)
    finally:
        shutdown(info)
