"""One assembly of a run, for both modes: ``prepare`` builds what a trainer process trains with (the process's
device, inputs, PTX pairs, the learner, the run folder: claim, resume, logger), ``make_loop`` the loop over
it and ``build_evaluator`` its held-out evaluation (also the Python API's ``GRPOTrainer.evaluate``). A mode
adds only its ``StepSource``: the colocated ``Sampling``, the decoupled trainer's ``Receiving``."""

from __future__ import annotations

import secrets
import socket
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from transformers.trainer_utils import enable_full_determinism

from grpo.algorithm import LogprobProcessing
from grpo.config import ConfigError, RunConfig, config_to_dict
from grpo.config.rules import ptx_max_length, updates_per_step
from grpo.critic import Critic, build_critic
from grpo.data import load_sft_pairs
from grpo.data.prompt_sampler import PromptSampler
from grpo.data.sft_tokens import tokenize_pairs
from grpo.evaluation.example_records import EvalRewards
from grpo.models.compiled import check_compile
from grpo.models.loading import check_memory_savers, compute_context, load_reference, resolve_device
from grpo.models.moe import router_loss
from grpo.models.precision import check_precision
from grpo.models.wrappers import unwrap_model
from grpo.multiturn.wiring import with_turns
from grpo.parallel.distributed import DistInfo, all_gather_json, barrier, init_distributed, print0
from grpo.parallel.fsdp import gathering
from grpo.parallel.trainable import Trainable, build_trainable, compile_settings, shard_for_run
from grpo.rollout.build import check_engine_for_policy, evaluation_engine
from grpo.run.best import BestMetric
from grpo.run.checkpoint import CheckpointLayout, checkpoint_layout
from grpo.run.run_dir import check_output_dir, claim_output_dir
from grpo.run.tracking import MetricsLogger
from grpo.step.experience import RefLogprobs, local_reference
from grpo.step.ptx import PtxData
from grpo.step.entropy_control import entropy_control
from grpo.step.ref_sync import RefSync
from grpo.tasks import Task, run_system_prompt
from grpo.training.eval_loss import LossPass
from grpo.training.evaluator import RunEvaluator, eval_settings, eval_sources
from grpo.training.inputs import GivenInputs, RunInputs, policy_for, tokenizer_and_data
from grpo.training.loop import Loop, PolicyUpdate
from grpo.training.process_exit import exit_quickly
from grpo.training.resume import resume_checkpoint
from grpo.training.schedule import Schedule, uses_epochs
from grpo.training.settings import (
    critic_settings,
    eval_loss_settings,
    logprob_pass,
    logprob_processing,
    loop_schedule,
    loss_settings,
    needs_critic,
)


def seed_process(seed: int, full_determinism: bool) -> None:
    """``train.full_determinism``: transformers' ``enable_full_determinism`` (its seeds, deterministic kernels and
    CUDA variables; before any CUDA work of the process, as cuBLAS reads its variable once); else torch's seed."""
    if full_determinism:
        enable_full_determinism(seed)
    else:
        torch.manual_seed(seed)


def start_process(cfg: RunConfig) -> tuple[DistInfo, torch.device]:
    """Join the process group (if launched with N ranks) and pick this rank's device."""
    if cfg.train.fast_exit:
        exit_quickly()
    seed_process(cfg.train.seed, cfg.train.full_determinism)
    device = resolve_device(cfg.train.device)
    # Collectives must outwait the longest wait a rank can make: rank 0 waiting decoupled.peer_timeout_s for a
    # batch while the others wait in a broadcast (NCCL's default 10 min is no longer than that wait's 600 s,
    # so the other ranks crashed first instead of rank 0's clean timeout), or an evaluation on rank 0.
    info = init_distributed(device.type, timeout_s=max(1800.0, 2 * cfg.decoupled.peer_timeout_s))
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return info, device


def load_ptx_data(cfg: RunConfig, tokenizer, info: DistInfo, task: Task):
    """The PTX pairs tokenized (a ``grpo.step.ptx.PtxData``), under the run's system prompt (``task``'s unless
    data.system_prompt), or None when ``ptx.data`` is null. Every rank reads the whole file (the order picks its
    rows); how many pairs were cut or left out to fit ptx.max_length is printed once."""
    if cfg.ptx.data is None:
        return None

    p = cfg.ptx
    pairs = load_sft_pairs(p.data, p.prompt_column, p.response_column, p.response_format, cfg.data.tag_style,
                           p.split)
    max_length = ptx_max_length(cfg)
    tokenized = tokenize_pairs(tokenizer, pairs, run_system_prompt(cfg, task), max_length)
    print0(info, f"ptx: {len(tokenized.rows)} of {len(pairs)} pairs from {p.data}; ptx.max_length {max_length}: "
                 f"{tokenized.cut} responses cut short, {tokenized.dropped} pairs left out (prompt too long)")
    return PtxData(tokenized.rows, micro_batch_size=p.micro_batch_size, world_size=info.world_size,
                   seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)


@dataclass
class OpenedRun:
    """The claimed run folder, where the run starts (after a resume) and its metrics logger."""

    out: Path
    start_step: int
    resumed_state: dict | None  # the checkpoint's trainer state, None for a new run
    logger: MetricsLogger
    layout: CheckpointLayout  # where its checkpoints go (train.checkpoint_layout)

    @property
    def eval_before(self) -> dict | None:
        """The evaluation before training that a resumed checkpoint recorded (None for a new run)."""
        return self.resumed_state.get("eval_before") if self.resumed_state else None


def check_shared_run_folder(out: Path, info: DistInfo) -> None:
    """Every rank must see the run folder rank 0 claimed: checkpoints, resume and metrics live there, and a
    node with its own copy would resume at another step (a hang or a silent divergence). Rank 0 writes a
    random token there, every rank reads it back; a ConfigError on every rank names the hosts that cannot."""
    if not info.enabled:
        return

    marker = out / ".grpo-shared-check"
    if info.is_main:
        marker.write_text(secrets.token_hex(16))
    token = all_gather_json(marker.read_text() if info.is_main else None, info)[0]  # after rank 0 wrote it
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    ranks = all_gather_json({"rank": info.rank, "host": socket.gethostname(), "seen": seen}, info)
    if info.is_main:
        marker.unlink(missing_ok=True)
    blind = [r for r in ranks if not r["seen"]]
    if blind:
        who = ", ".join(f"rank {r['rank']} on {r['host']}" for r in blind)
        raise ConfigError(f"train.output_dir: {out} is not one folder for every rank: {who} cannot see the files "
                          f"rank 0 ({ranks[0]['host']}) writes there; put the run folder on a filesystem every node "
                          "mounts at the same path (NFS, Lustre, ...)")


def open_run(cfg: RunConfig, trainable: Trainable, info: DistInfo, critic=None,
             reference: torch.nn.Module | None = None) -> OpenedRun:
    """Claim the run folder (setup succeeded: only now is anything written), resume from its newest
    checkpoint that loads when ``train.resume`` (``train.resume_from``: that one; a moving ``reference`` too), and
    open the metrics logger."""
    layout = run_layout(cfg)
    out = claim_output_dir(cfg, info.is_main, layout)
    barrier(info)
    check_shared_run_folder(out, info)
    resuming = cfg.train.resume or cfg.train.resume_from is not None
    only = Path(cfg.train.resume_from) if cfg.train.resume_from is not None else None
    resumed = resume_checkpoint(out, trainable, info, critic, layout, only, reference) if resuming else None
    start_step, state = 0, None
    if resumed is not None:
        checkpoint, state = resumed
        start_step = state["step"]
        print0(info, f"resumed from {checkpoint} (step {start_step})")
    # A resume that found no checkpoint starts over, and so do its metrics (resume_step 0 would keep the
    # killed run's step-0 evaluation and log it a second time).
    logger = MetricsLogger(out, cfg.log.report_to, config_to_dict(cfg), enabled=info.is_main,
                           resume_step=start_step if resumed is not None else None,
                           wandb_project=cfg.log.wandb_project)
    return OpenedRun(out, start_step, state, logger, layout)


def run_layout(cfg: RunConfig) -> CheckpointLayout:
    return checkpoint_layout(cfg.train.checkpoint_layout, updates_per_step(cfg))


@dataclass
class Prepared:
    """What a trainer process trains with, built alike in both modes by ``prepare``."""

    info: DistInfo
    device: torch.device
    inputs: RunInputs  # the task, tokenizer, data and rewards (a decoupled trainer's data: only to evaluate)
    ptx_data: object | None  # grpo.step.ptx.PtxData (ptx.data), None when off
    policy: torch.nn.Module
    compute: AbstractContextManager  # bf16/fp16 autocast over fp32 weights, TF32 (grpo.models.loading)
    processing: LogprobProcessing | None  # the sampling controls every log-prob pass follows
    trainable: Trainable
    run: OpenedRun
    schedule: Schedule  # when the loop checkpoints, evaluates and logs (its epoch: data.train's, counted here)
    prompt_sampler: PromptSampler | None = None  # colocated: which prompts a rank samples at a step
    ref_logprobs: RefLogprobs | None = None  # colocated with loss.beta > 0: the frozen initial weights'
    critic: Critic | None = None  # PPO (algorithm.advantage_estimator gae), colocated only
    moving_reference: torch.nn.Module | None = None  # loss.ref_sync_steps: the reference TR-DPO moves
    # FSDP2: the policy and reference gathered while a block runs passes that differ per rank (sampling,
    # evaluation: grpo.parallel.fsdp.gathered); a context that does nothing otherwise
    gathered: Callable[[], AbstractContextManager] = nullcontext


def prepare(cfg: RunConfig, given: GivenInputs, info: DistInfo, device: torch.device, *,
            samples: bool) -> Prepared:
    """Everything a trainer process builds before its loop, in one order for both modes: checks, the inputs,
    PTX pairs, the policy and its learner, PPO's critic, then the run folder (claimed only now that the setup
    succeeded, and resumed when asked). ``samples``: this process samples its own batches (colocated), so it
    loads the training data, a prompt sampler and the reference; a decoupled trainer's samplers do that, and it
    loads data only to evaluate."""
    if info.is_main:
        check_output_dir(cfg)
    torch.manual_seed(cfg.train.seed)  # again: whatever ran since start_process drew from it
    epochs = uses_epochs(cfg.train.save_strategy, cfg.train.eval_strategy, cfg.log.logging_strategy)
    # a decoupled trainer reads data.train only to count an epoch strategy's epochs (its samplers sample it)
    inputs = tokenizer_and_data(cfg, given, data=samples or epochs or bool(eval_sources(cfg.data.eval)))
    tokenizer = inputs.tokenizer
    schedule = loop_schedule(cfg, len(inputs.train_set))  # an epoch strategy's ConfigError before anything loads
    ptx_data = load_ptx_data(cfg, tokenizer, info, inputs.task)
    prompt_sampler = None
    if samples:
        prompt_sampler = PromptSampler(len(inputs.train_set), cfg.train.prompts_per_step, cfg.train.seed,
                                       cfg.data.shuffle)
        share = len(prompt_sampler.rank_indices(1, info.rank, info.world_size))  # checks P divides by the ranks
        if share % cfg.train.mini_batches:  # the config cannot know the ranks torchrun starts
            raise ConfigError(f"train.mini_batches {cfg.train.mini_batches} does not divide each rank's {share} "
                              f"prompts (train.prompts_per_step {cfg.train.prompts_per_step} over {info.world_size} "
                              "ranks): each rank splits its own share into whole-group mini-batches")
    check_memory_savers(cfg.model, cfg.optim.optimizer, device)
    check_precision(cfg.model, device)
    if compile_settings(cfg) is not None:
        check_compile(compile_settings(cfg))
    deepspeed = bool(cfg.train.deepspeed)
    policy = policy_for(cfg, given, device, deepspeed)
    # half-precision autocast over fp32 master weights, TF32; DeepSpeed and FSDP2 (bf16 units gathered from fp32
    # shards) cast themselves
    compute = compute_context(cfg.model, device, deepspeed or cfg.train.fsdp)
    local_ref = samples and cfg.loss.beta > 0
    reference = (load_reference(cfg.model, policy, tokenizer, device, moving=cfg.loss.ref_sync_steps is not None)
                 if local_ref else None)  # before any update
    processing = logprob_processing(cfg, policy, tokenizer)  # every log-prob pass follows the sampling controls
    ref_logprobs = (local_reference(policy, reference, cfg.rollout.temperature, cfg.train.micro_batch_size,
                                    processing, logprob_pass(cfg)) if local_ref else None)
    trainable = build_trainable(cfg, policy, info, given.optimizer, given.scheduler)
    if samples:
        check_engine_for_policy(cfg, policy)  # as the learner sharded it, before the folder is claimed
    if trainable.fsdp and reference is not None:
        shard_for_run(cfg, reference)  # as the policy, no optimizer: 1/N of it on each rank between samplings
    critic = build_critic(cfg, info, device) if needs_critic(cfg) else None
    moving = reference if cfg.loss.ref_sync_steps else None  # a copy of the policy (or its base): not a teacher
    run = open_run(cfg, trainable, info, critic, moving)
    return Prepared(info, device, inputs, ptx_data, policy, compute, processing, trainable, run, schedule,
                    prompt_sampler, ref_logprobs, critic, moving, partial(gathering, policy, reference))


def build_evaluator(cfg: RunConfig, inputs: RunInputs, policy: torch.nn.Module, info: DistInfo,
                    out: Path | None = None, engine=None, base_engine=None,
                    ref_logprobs: RefLogprobs | None = None) -> RunEvaluator | None:
    """The run's evaluation of its held-out sets (None without any), scored by its task and rewards, records
    written to ``out`` (None: not written). ``engine``: the one the run samples with (colocated; multi-turn when
    the run has tools or environments), ``base_engine`` the one it wraps; None: an evaluation engine over
    ``policy`` (``rollout.engine``, for vLLM ``auto``'s: a decoupled trainer's samplers and the Python API's
    weights are elsewhere), wrapped for the run's turns. Under a rollout hook the evaluation runs
    ``base_engine``, without rewards: a hook's rollouts and the columns its rewards read are the user's.
    With ``eval.loss_pass`` each set's loss too (``grpo.training.eval_loss``; ``ref_logprobs``: the reference's,
    for ``eval/kl``), except under a rollout hook (no rewards) and for PPO (no critic's values there)."""
    if not inputs.eval_sets:
        return None
    if engine is None:
        base_engine = evaluation_engine(cfg, policy, inputs.tokenizer)
        engine = with_turns(base_engine, inputs.turns, cfg, policy, inputs.tokenizer)
    hooked = inputs.turns.rollout_func is not None
    rewards = EvalRewards(inputs.reward_fns, inputs.reward_weights) if inputs.reward_fns and not hooked else None
    loss_pass = None
    if cfg.eval.loss_pass and rewards is not None and not needs_critic(cfg):
        module = unwrap_model(policy)
        settings = eval_loss_settings(cfg, inputs.task, logprob_processing(cfg, module, inputs.tokenizer),
                                      next(module.parameters()).device.type,
                                      router_loss(module, cfg.loss.router_aux_loss_coef))
        loss_pass = LossPass(settings, engine, module, inputs.tokenizer, inputs.reward_fns, inputs.reward_weights,
                             ref_logprobs)
    return RunEvaluator(eval_settings(cfg, inputs.task, info.world_size), inputs.eval_sets,
                        base_engine if hooked else engine, policy, inputs.tokenizer, info, rewards, out, loss_pass)


def make_loop(cfg: RunConfig, prepared: Prepared, progress: AbstractContextManager,
              evaluate: RunEvaluator | None = None) -> Loop:
    """The loop over ``prepared``'s run: its update (the policy with the step's PTX micro-batch, then PPO's
    critic), schedule, evaluation (``build_evaluator``'s) with ``train.best_metric``'s best weights, and the
    logged accuracy by the task's own scorer; ``progress`` shows the steps (grpo.run.progress)."""
    p, run, info = prepared, prepared.run, prepared.info
    ref_sync = (RefSync(p.moving_reference, p.trainable.policy, cfg.loss.ref_mixup_alpha, cfg.loss.ref_sync_steps)
                if p.moving_reference is not None else None)
    entropy = entropy_control(cfg, run.resumed_state)
    router = router_loss(unwrap_model(p.policy), cfg.loss.router_aux_loss_coef)
    update = PolicyUpdate(p.trainable, loss_settings(cfg, p.processing, p.device.type, router), info, p.ptx_data,
                          p.critic, critic_settings(cfg), ref_sync, entropy)
    best = (BestMetric.resumed(run.out, cfg.train.best_metric, cfg.train.best_metric_mode)
            if cfg.train.best_metric and evaluate is not None else None)
    return Loop(p.schedule, update, p.trainable, p.inputs.tokenizer, run.out, info, run.logger, progress,
                p.compute, cfg.rollout.num_generations, cfg.data.tag_style, cfg.train.save_total_limit,
                evaluate=evaluate, best=best, critic=p.critic, hooks=p.inputs.hooks, score=p.inputs.task.score,
                layout=run.layout, reference=p.moving_reference, entropy=entropy, gathered=p.gathered)
