"""The colocated GRPO loop: one process (or N data-parallel ranks) samples, scores and learns.

Each step: this rank's prompts (``PromptSampler``) -> ``make_experience`` (generate, rewards,
advantages, old/ref log-probs) -> ``train_on_batch`` (clipped surrogate, AdamW) -> metrics,
samples, checkpoints, evaluation. Setup and the per-step pieces are small functions below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import RunConfig
from grpo.data import load_dataset_source, resolve_system_prompt
from grpo.distributed import DistInfo, all_reduce_mean, barrier, init_distributed, print0, shutdown
from grpo.experience import ExperienceSettings, correctness, make_experience
from grpo.models import load_policy, load_reference, load_tokenizer, resolve_device
from grpo.learners import build_learner
from grpo.optimization import LossSettings, build_optimizer, build_scheduler, train_on_batch
from grpo.prompt_sampler import PromptSampler
from grpo.records import RolloutBatch
from grpo.rewards import build_reward_functions
from grpo.rollout import HFEngine, SamplingParams
from grpo.rollout.hf import unwrap_model
from grpo.run_dir import prepare_output_dir
from grpo.step_metrics import rollout_metrics, sample_records


@dataclass
class TrainResult:
    output_dir: Path
    last_step: int
    eval_before: dict | None
    eval_after: dict | None
    interrupted: bool = False


def step_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible sampling seed per (run seed, step, rank): a resumed run draws the
    same completions as an uninterrupted one."""
    return (seed * 1_000_003 + step * 1_009 + rank) % (2**63)


def experience_settings(cfg: RunConfig) -> ExperienceSettings:
    """The rollout-side settings from the config tree."""
    r = cfg.rollout
    return ExperienceSettings(
        sampling=SamplingParams(n=r.num_generations, max_tokens=r.max_completion_length,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        system_prompt=resolve_system_prompt(cfg.data.system_prompt, cfg.data.tag_style), tag_style=cfg.data.tag_style,
        max_prompt_length=cfg.data.max_prompt_length, scale_rewards=cfg.loss.scale_rewards,
        advantage_eps=cfg.loss.advantage_eps, need_old_logprobs=cfg.loss.num_iterations > 1,
        need_ref_logprobs=cfg.loss.beta > 0, logprob_batch_size=cfg.train.micro_batch_size)


def loss_settings(cfg: RunConfig) -> LossSettings:
    """The update-side settings from the config tree."""
    return LossSettings(
        epsilon=cfg.loss.epsilon, epsilon_high=cfg.loss.epsilon_high, beta=cfg.loss.beta,
        loss_type=cfg.loss.loss_type, max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature, num_iterations=cfg.loss.num_iterations,
        micro_batch_size=cfg.train.micro_batch_size, max_grad_norm=cfg.optim.max_grad_norm)


def run_eval(cfg: RunConfig, model, tokenizer, examples, info: DistInfo) -> dict | None:
    """Greedy held-out accuracy on rank 0 (others wait); None without a held-out set."""
    if not examples:
        return None
    from grpo.evaluate import evaluate

    result = None
    if info.is_main:
        result = evaluate(unwrap_model(model), tokenizer, examples, tag_style=cfg.data.tag_style,
                          system_prompt=resolve_system_prompt(cfg.data.system_prompt, cfg.data.tag_style),
                          batch_size=max(cfg.train.micro_batch_size, 16),
                          max_new_tokens=cfg.rollout.max_completion_length, progress=False)
    barrier(info)
    return result


def train(cfg: RunConfig) -> TrainResult:
    """Run GRPO as configured; returns where the run went and its before/after evaluation."""
    from grpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final
    from grpo.progress import StepProgress
    from grpo.tracking import MetricsLogger

    device = resolve_device(cfg.train.device)
    info = init_distributed(device.type)
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    try:
        out = prepare_output_dir(cfg, info.is_main)
        barrier(info)
        torch.manual_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
        train_set = load_dataset_source(cfg.data.train, split=cfg.data.split, limit=cfg.data.train_limit)
        eval_set = (load_dataset_source(cfg.data.eval, split=cfg.data.eval_split, limit=cfg.data.eval_limit)
                    if cfg.data.eval else [])
        sampler = PromptSampler(len(train_set), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
        sampler.rank_indices(1, info.rank, info.world_size)  # checks P is divisible by the ranks, early
        policy = load_policy(cfg.model, device)
        reference = load_reference(cfg.model, policy, tokenizer, device) if cfg.loss.beta > 0 else None
        reward_fns = build_reward_functions(cfg.rewards, cfg.data.tag_style)
        weights = [r.weight for r in cfg.rewards]
        optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps * cfg.loss.num_iterations)

        start_step, eval_before = 0, None
        if cfg.train.resume:
            checkpoint = latest_checkpoint(out)
            if checkpoint is not None:
                state = load_checkpoint(checkpoint, policy, optimizer, scheduler)
                start_step, eval_before = state["step"], state.get("eval_before")
                print0(info, f"resumed from {checkpoint} (step {start_step})")
        learner = build_learner(policy, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=None,
                                max_grad_norm=cfg.optim.max_grad_norm)
        engine = HFEngine(policy, tokenizer, cfg.rollout.generation_batch_size)
        exp_settings, train_settings = experience_settings(cfg), loss_settings(cfg)
        logger = MetricsLogger(out, cfg.log.report_to, _config_dict(cfg), enabled=info.is_main,
                               resume_step=start_step if cfg.train.resume else None,
                               wandb_project=cfg.log.wandb_project)

        if start_step == 0 and eval_set:
            eval_before = run_eval(cfg, policy, tokenizer, eval_set, info)
            logger.log(0, _eval_metrics(eval_before))
        eval_after, step, interrupted = None, start_step, False
        progress = StepProgress(cfg.train.max_steps, start_step, enabled=info.is_main and cfg.log.progress_bar)

        def checkpoint_now(at_step: int) -> None:
            state = {"step": at_step, "prompts_consumed": at_step * cfg.train.prompts_per_step,
                     "eval_before": eval_before}
            if info.is_main:
                save_checkpoint(out, at_step, policy, tokenizer, optimizer, scheduler, state,
                                cfg.train.save_total_limit)
            barrier(info)

        try:
            with progress:
                for step in range(start_step + 1, cfg.train.max_steps + 1):
                    t0 = time.perf_counter()
                    examples = [train_set[i] for i in sampler.rank_indices(step, info.rank, info.world_size)]
                    batch = make_experience(engine, policy, reference, tokenizer, examples, reward_fns, weights,
                                            exp_settings, seed=step_seed(cfg.train.seed, step, info.rank))
                    t1 = time.perf_counter()
                    train_stats = train_on_batch(learner, batch, train_settings, info)
                    t2 = time.perf_counter()
                    metrics = _step_metrics(cfg, batch, examples, train_stats, (t0, t1, t2), info)
                    metrics["epoch"] = sampler.epoch_of(step)
                    if cfg.train.eval_steps and step % cfg.train.eval_steps == 0 and step < cfg.train.max_steps:
                        result = run_eval(cfg, policy, tokenizer, eval_set, info)
                        metrics.update(_eval_metrics(result))
                    logger.log(step, metrics)
                    if cfg.log.num_samples and step % cfg.log.logging_steps == 0:
                        logger.log_samples(step, sample_records(batch, examples, cfg.log.num_samples,
                                                                cfg.data.tag_style))
                    progress.update(step, metrics)
                    if step % cfg.train.save_steps == 0 or step == cfg.train.max_steps:
                        checkpoint_now(step)
                    target = cfg.train.early_stop_accuracy
                    if target is not None and metrics.get("eval/accuracy", -1.0) >= target:
                        print0(info, f"eval/accuracy {metrics['eval/accuracy']:.3f} reached {target}: stopping")
                        if step % cfg.train.save_steps != 0:
                            checkpoint_now(step)
                        break
        except KeyboardInterrupt:
            interrupted = True
            last_done = step - 1 if step > start_step else start_step
            print0(info, f"\ninterrupted: saving a checkpoint of step {last_done}")
            if last_done > start_step:
                checkpoint_now(last_done)
            logger.close()
            raise

        if eval_set:
            eval_after = run_eval(cfg, policy, tokenizer, eval_set, info)
            logger.log(step, _eval_metrics(eval_after))
        logger.close()
        if info.is_main:
            save_final(out, policy, tokenizer)
            from grpo.plots import plot_run

            plot_run(out)
        barrier(info)
        return TrainResult(out, step, eval_before, eval_after, interrupted)
    finally:
        shutdown(info)


def _config_dict(cfg: RunConfig) -> dict:
    from grpo.config import config_to_dict

    return config_to_dict(cfg)


def _eval_metrics(result: dict | None) -> dict[str, float]:
    if not result:
        return {}
    return {"eval/accuracy": result["accuracy"], "eval/format_rate": result["format_rate"]}


def _step_metrics(cfg: RunConfig, batch: RolloutBatch, examples, train_stats: dict, times: tuple,
                  info: DistInfo) -> dict[str, float]:
    correct, formatted = correctness(batch.generation.completions, examples, cfg.rollout.num_generations,
                                     cfg.data.tag_style)
    local = rollout_metrics(batch, correct, formatted, cfg.rollout.num_generations)
    local.update({k: train_stats[k] for k in ("loss", "kl", "clip_fraction", "ratio_mean")})
    keys = sorted(local)
    averaged = all_reduce_mean(torch.tensor([local[k] for k in keys], dtype=torch.float64), info)
    metrics = dict(zip(keys, averaged.tolist()))
    # reward/std over all ranks from the averaged first and second moments
    metrics["reward/std"] = max(metrics.pop("reward/mean_sq") - metrics["reward/mean"] ** 2, 0.0) ** 0.5
    t0, t1, t2 = times
    step_s = time.perf_counter() - t0
    completion_tokens = float(batch.generation.completion_mask.sum()) * info.world_size
    metrics.update({
        "learning_rate": train_stats["learning_rate"], "grad_norm": train_stats["grad_norm"],
        "skipped_updates": train_stats["skipped_updates"],
        "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/step_s": step_s,
        "tokens_per_s": completion_tokens / step_s,
    })
    return metrics
