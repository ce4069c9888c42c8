"""Setup shared by the roles that train or sample (colocated trainer, decoupled trainer, sampler):
the process/device, data, config-derived settings, the learner, checkpoints, and evaluation."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.algorithm import LogprobProcessing
from grpo.config import RunConfig
from grpo.config.rules import ptx_max_length
from grpo.data import load_dataset_source, resolve_system_prompt
from grpo.errors import TrainingAborted
from grpo.distributed import DistInfo, barrier, init_distributed, print0
from grpo.experience import ExperienceSettings, GaeSettings
from grpo.learners import Learner, build_learner, deepspeed_config, zero3_full_state_dict
from grpo.models import resolve_device
from grpo.optimization import LossSettings, build_optimizer, build_scheduler
from grpo.rollout import SamplingParams
from grpo.rollout.hf import eos_token_ids, unwrap_model


def start_process(cfg: RunConfig) -> tuple[DistInfo, torch.device]:
    """Join the process group (if launched with N ranks) and pick this rank's device."""
    device = resolve_device(cfg.train.device)
    info = init_distributed(device.type)
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return info, device


def load_data(cfg: RunConfig) -> tuple[list, list]:
    """(training examples, held-out examples or [])."""
    train_set = load_dataset_source(cfg.data.train, split=cfg.data.split, limit=cfg.data.train_limit)
    eval_set = (load_dataset_source(cfg.data.eval, split=cfg.data.eval_split, limit=cfg.data.eval_limit)
                if cfg.data.eval else [])
    return train_set, eval_set


def build_rewards(cfg: RunConfig, examples: Sequence | None = None) -> tuple[list, list[float]]:
    """The configured reward functions and their weights; a reward that cannot be built (unknown
    name, a dotted path that does not import, bad params or factory_args) or, given the training
    ``examples``, cannot take TRL's keyword call with their columns is a configuration error naming it."""
    from grpo.config import ConfigError
    from grpo.rewards import build_reward_functions

    column_names = list(examples[0].columns()) if examples else None
    try:
        functions = build_reward_functions(cfg.rewards, cfg.data.tag_style, column_names)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"rewards: {err}") from None
    except SyntaxError as err:
        # A user's reward module with a syntax error is not an ImportError: without this it left the
        # command with a traceback (exit 1) instead of a configuration error naming the reward.
        names = ", ".join(repr(r.name) for r in cfg.rewards if ":" in r.name)
        raise ConfigError(f"rewards: reward {names} does not import: {err.filename}:{err.lineno}: "
                          f"SyntaxError: {err.msg}") from None
    return functions, [r.weight for r in cfg.rewards]


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
    """The cap on dynamic sampling's rounds (``grpo.experience.rank_experience``'s ``max_rounds``); None when off."""
    return cfg.rollout.dynamic_sampling_max_rounds if cfg.rollout.dynamic_sampling else None


def load_ptx_data(cfg: RunConfig, tokenizer, info: DistInfo):
    """The PTX pairs tokenized (a ``grpo.ptx.PtxData``), or None when ``ptx.data`` is null. Every rank
    reads the whole file (the order picks its rows); how many pairs were cut or left out to fit ptx.max_length
    is printed once."""
    if cfg.ptx.data is None:
        return None
    from grpo.data import load_sft_pairs
    from grpo.ptx import PtxData, tokenize_pairs

    p = cfg.ptx
    pairs = load_sft_pairs(p.data, p.prompt_column, p.response_column, p.response_format, cfg.data.tag_style,
                           p.split)
    max_length = ptx_max_length(cfg)
    tokenized = tokenize_pairs(tokenizer, pairs, resolve_system_prompt(cfg.data.system_prompt, cfg.data.tag_style),
                               max_length)
    print0(info, f"ptx: {len(tokenized.rows)} of {len(pairs)} pairs from {p.data}; ptx.max_length {max_length}: "
                 f"{tokenized.cut} responses cut short, {tokenized.dropped} pairs left out (prompt too long)")
    return PtxData(tokenized.rows, micro_batch_size=p.micro_batch_size, world_size=info.world_size,
                   seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)


@dataclass
class Trainable:
    """The policy and what updates it. ``optimizer``/``scheduler`` are None under DeepSpeed (the engine owns them)."""

    policy: torch.nn.Module
    learner: Learner
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    deepspeed: bool


def build_trainable(cfg: RunConfig, policy: torch.nn.Module, info: DistInfo) -> Trainable:
    """Optimizer, schedule and learner (DeepSpeed when ``train.deepspeed`` names a config, else torch/DDP)."""
    optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0,
                                allow_fused=not cfg.train.deepspeed)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps * cfg.loss.num_iterations)
    ds_config = None
    if cfg.train.deepspeed:
        completions_per_rank = cfg.train.prompts_per_step * cfg.rollout.num_generations // info.world_size
        ds_config = deepspeed_config(
            cfg.train.deepspeed, micro_batch_size=cfg.train.micro_batch_size,
            # + 1 with PTX: its micro-batch's backward comes before each update too (see train_on_batch), and
            # DeepSpeed steps at its own count of backwards.
            accumulation_steps=max(1, completions_per_rank // cfg.train.micro_batch_size) + bool(cfg.ptx.data),
            world_size=info.world_size, max_grad_norm=cfg.optim.max_grad_norm, bf16=cfg.model.bf16)
    learner = build_learner(policy, optimizer, scheduler, ddp=info.enabled, deepspeed_config_dict=ds_config,
                            max_grad_norm=cfg.optim.max_grad_norm)
    if ds_config is not None:
        return Trainable(policy, learner, None, None, deepspeed=True)
    return Trainable(policy, learner, optimizer, scheduler, deepspeed=False)


class SkipGuard:
    """Counts steps whose updates were all skipped (non-finite gradients); too many in a row aborts
    the run, leaving the last good checkpoint as it is, instead of training on garbage for hours."""

    def __init__(self, max_consecutive: int, updates_per_step: int):
        self.max_consecutive, self.updates_per_step = max_consecutive, updates_per_step
        self.consecutive = 0

    def record(self, step: int, train_stats: dict) -> None:
        all_skipped = train_stats["skipped_updates"] >= self.updates_per_step
        self.consecutive = self.consecutive + 1 if all_skipped else 0
        if self.consecutive >= self.max_consecutive:
            raise TrainingAborted(
                f"step {step}: the gradients were non-finite (NaN/inf) in {self.consecutive} consecutive steps "
                f"(optim.max_skipped_steps {self.max_consecutive}); those updates were skipped and the last "
                "checkpoint is intact. Lower the learning rate or check the rewards and data.")


def _deepspeed_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"deepspeed-step-{step}"


def save_run_checkpoint(out: Path, step: int, trainable: Trainable, tokenizer, state: dict, cfg: RunConfig,
                        info: DistInfo, critic=None) -> None:
    """A checkpoint of ``step`` on every rank's behalf. Under DeepSpeed every rank first writes its
    engine state (partitioned optimizer) to ``deepspeed-step-N/``; rank 0 then writes the HF-format
    checkpoint, whose appearance (atomic rename) marks the whole checkpoint complete. PPO's ``critic``
    (a ``grpo.critic.Critic``) goes into its ``critic/`` folder."""
    from grpo.checkpoint import save_checkpoint
    from grpo.critic import CRITIC_DIR, save_critic

    write_critic = (lambda folder: save_critic(folder / CRITIC_DIR, critic)) if critic is not None else None

    if trainable.deepspeed:
        trainable.learner.engine.save_checkpoint(str(_deepspeed_dir(out, step)))
        state = {**state, "deepspeed_dir": _deepspeed_dir(out, step).name}
    gathered = zero3_full_state_dict(trainable.learner)  # a collective under ZeRO-3
    if info.is_main:
        save_checkpoint(out, step, trainable.policy, tokenizer, trainable.optimizer, trainable.scheduler, state,
                        cfg.train.save_total_limit, state_dict=gathered, write_extra=write_critic)
        if trainable.deepspeed:
            _prune_deepspeed_dirs(out, keep=cfg.train.save_total_limit)
    barrier(info)


def _prune_deepspeed_dirs(out: Path, keep: int | None) -> None:
    # Engine states whose HF checkpoint was pruned are unreachable: drop them too.
    import shutil

    live = {p.name.removeprefix("step-") for p in (out / "checkpoints").glob("step-*")}
    for engine_dir in (out / "checkpoints").glob("deepspeed-step-*"):
        if keep is not None and engine_dir.name.removeprefix("deepspeed-step-") not in live:
            shutil.rmtree(engine_dir, ignore_errors=True)


def load_run_checkpoint(checkpoint: Path, trainable: Trainable, critic=None) -> dict:
    """Restore weights, optimizer, schedule and RNG from ``checkpoint`` (and PPO's ``critic`` from its
    ``critic/`` folder); returns its trainer state. Under DeepSpeed the engine restores weights and its
    partitioned optimizer itself."""
    import json

    from grpo.checkpoint import load_checkpoint
    from grpo.critic import CRITIC_DIR, load_critic

    if critic is not None:  # first: a checkpoint without a critic must fail before the policy is overwritten
        load_critic(checkpoint / CRITIC_DIR, critic)
    if trainable.deepspeed:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        trainable.learner.engine.load_checkpoint(str(checkpoint.parent / state["deepspeed_dir"]))
        return state
    return load_checkpoint(checkpoint, trainable.policy, trainable.optimizer, trainable.scheduler)


def resume_checkpoint(out: Path, trainable: Trainable, info: DistInfo, critic=None) -> tuple[Path, dict] | None:
    """Restore the newest checkpoint of ``out`` that loads; returns it and its trainer state, or None
    when the folder holds no checkpoint.

    A checkpoint is written to a temporary folder and renamed, so a crash cannot tear one; a torn or
    corrupt file therefore means the disk or someone damaged it. The newest checkpoint that loads is
    used instead, with a warning naming the bad file: a run restarted unattended (a job scheduler, the
    decoupled launcher) then goes on losing only the steps after it, which it trains again exactly as
    before (prompts and sampling seeds are functions of the step), and the bad folder is replaced when
    the run saves that step again. When no checkpoint loads (e.g. the model no longer fits them) the
    newest one's error is raised: starting from scratch would silently discard the run.
    """
    from grpo.checkpoint import CheckpointError, complete_checkpoints

    candidates = complete_checkpoints(out)[::-1]  # newest first
    first_error = None
    for checkpoint in candidates:
        try:
            return checkpoint, load_run_checkpoint(checkpoint, trainable, critic)
        except CheckpointError as err:
            first_error = first_error or err
            if info.is_main:  # every rank reads the same files and reaches the same checkpoint
                print(f"grpo: warning: cannot resume from {checkpoint}: {err}; trying the checkpoint before it",
                      file=sys.stderr, flush=True)
    if first_error is not None:
        raise CheckpointError(f"no checkpoint in {out / 'checkpoints'} can be loaded; the newest: {first_error}")
    return None


class DeferredInterrupt:
    """Hold Ctrl-C (SIGINT) while the block runs, then raise ``KeyboardInterrupt`` at its end.

    The training loop wraps each step's update, logging and checkpoint in one: an interrupt there would
    leave weights that belong to no step (half the ``num_iterations`` updates done, or the update done
    but not logged), and a checkpoint of them under the previous step's number would train the step's
    batch twice after resuming. A second Ctrl-C stops at once and sets ``forced``: the caller must then
    save nothing (the last checkpoint stays the newest). Outside the main thread (where signal handlers
    cannot be installed, and where SIGINT is never delivered) it does nothing.
    """

    def __init__(self) -> None:
        self.received = False
        self.forced = False

    @contextmanager
    def holding(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def hold(signum, frame) -> None:
            if self.received:
                self.forced = True
                raise KeyboardInterrupt
            self.received = True
            # os.write, not print: a handler that prints while the interrupted code is printing to the same
            # buffered stream fails with "reentrant call".
            os.write(2, b"\ngrpo: Ctrl-C: finishing this step and saving it (Ctrl-C again to stop at once, "
                        b"without saving it)\n")

        previous = signal.signal(signal.SIGINT, hold)
        try:
            yield
        finally:
            # None: the previous handler was not installed from Python; Python's own is the closest.
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        if self.received:
            raise KeyboardInterrupt


def run_eval(cfg: RunConfig, model, tokenizer, examples, info: DistInfo) -> dict | None:
    """Greedy held-out accuracy on rank 0 (others wait); None without a held-out set.

    Without rollout.repetition_penalty / min_new_tokens / min_p: they shape exploration during training,
    while the held-out accuracy measures the policy itself, greedily, comparable across runs that
    sample differently (and with the before-training figure)."""
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


def eval_metrics(result: dict | None) -> dict[str, float]:
    """``eval/accuracy`` and ``eval/format_rate`` of an evaluation result (empty for None)."""
    if not result:
        return {}
    return {"eval/accuracy": result["accuracy"], "eval/format_rate": result["format_rate"]}
