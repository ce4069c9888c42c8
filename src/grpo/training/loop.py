"""The loop both training modes run, written once: ``collect`` a step's batch, ``update``, ``record``.

A mode supplies a ``StepSource``: how this rank gets a step's batch (the colocated loop samples it, the
decoupled trainer role receives it) and what it does after the update (push weights to an engine, publish
them to samplers, acknowledge the batch) and around a checkpoint. The rest is here: which step the
weights belong to, when to checkpoint, Ctrl-C (a step's update, logging and checkpoint finish first; then
the last finished step is saved), evaluation, logging, early stopping, the NaN guard and the final save.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from grpo.critic import CriticSettings, train_critic
from grpo.parallel.distributed import DistInfo, all_gather_json, barrier, print0
from grpo.parallel.learners import full_weights
from grpo.parallel.trainable import Trainable
from grpo.run.best import BestMetric
from grpo.run.checkpoint import BEST_DIR, GRPO_LAYOUT, CheckpointLayout, load_weights, save_best, save_final
from grpo.run.plots import plot_run
from grpo.run.tracking import MetricsLogger
from grpo.step.metrics import sample_records, step_metrics, update_metrics
from grpo.step.entropy_control import EntropyControl
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.step.records import RolloutBatch, StepUpdate
from grpo.training.evaluator import eval_metrics
from grpo.training.guards import DeferredInterrupt, RankAgreedStop, SkipGuard, sigterm_as_interrupt
from grpo.training.resume import save_run_checkpoint
from grpo.training.schedule import EPOCH, Schedule


@dataclass
class Collected:
    """This rank's batch for one step, and what getting it measured."""

    batch: RolloutBatch
    rollout_s: float  # seconds spent getting the batch (sampling, or waiting for a sampler's)
    rollout_stats: dict[str, float] = field(default_factory=dict)  # this rank's; averaged over ranks
    metrics: dict[str, float] = field(default_factory=dict)  # logged as they are (the off-policy guard's)
    # this rank's rows over the mean rows per rank, its weight in the means over ranks (1.0: every rank as
    # many; decoupled partial rollouts split a step's varying group count unevenly)
    rank_share: float = 1.0


class StepSource(Protocol):
    """What a mode adds to the loop."""

    def collect(self, step: int, stop_requested: Callable[[], bool]) -> Collected:
        """This rank's batch for ``step``. A source that may wait long (for other processes) checks
        ``stop_requested`` meanwhile and raises KeyboardInterrupt on every rank alike when it turns true."""

    def after_update(self, step: int, collected: Collected, checkpointing: bool) -> dict[str, float]:
        """Runs once the step's update is done (weights pushed or published); returns metrics to log.
        ``checkpointing``: this step will be checkpointed next."""

    def checkpoint_state(self, step: int, collected: Collected | None) -> dict:
        """The mode's part of the trainer state saved with the checkpoint of ``step`` (``collected``: the
        step's own batch when the checkpoint follows its update, None for an earlier finished step)."""

    def checkpoint_written(self, step: int, collected: Collected | None) -> None:
        """Runs once that checkpoint is on disk."""


@dataclass
class PolicyUpdate:
    """A step's update on this rank: the policy (with the step's PTX micro-batch), then PPO's critic."""

    trainable: Trainable
    settings: LossSettings
    info: DistInfo
    ptx_data: object | None = None  # grpo.step.ptx.PtxData
    critic: object | None = None  # grpo.critic.Critic
    critic_settings: CriticSettings | None = None
    ref_sync: Callable[[int], bool] | None = None  # TR-DPO's moving reference (grpo.step.ref_sync.RefSync)
    entropy: EntropyControl | None = None  # loss.adaptive_entropy: the bonus's coefficient, moved every update

    def __call__(self, step: int, batch: RolloutBatch) -> StepUpdate:
        ptx_batch = self.ptx_data.batch(step, self.info.rank) if self.ptx_data else None
        stats = train_on_batch(self.trainable.learner, batch, self.settings, self.info, ptx_batch, self.entropy)
        if self.critic is not None:
            stats.totals.update(train_critic(self.critic.learner, batch, self.critic_settings))
        if self.ref_sync is not None:  # after the update, before the step's evaluation: TRL's on_step_end
            self.ref_sync(step)
        return stats


@dataclass
class StepReport:
    """What a finished step hands the hooks."""

    metrics: dict[str, float]  # as logged to metrics.jsonl, over all ranks
    updates: list[dict[str, float]]  # each optimizer update's, over all ranks (grpo.step.metrics.update_metrics)
    batch: RolloutBatch  # this rank's rollouts (prompts, completions, rewards, advantages)


class LoopHooks:
    """Where the loop calls out (the Python API's callbacks, ``grpo.api``); here every call does nothing."""

    def train_begin(self, start_step: int, max_steps: int, steps_per_epoch: int | None = None) -> None:
        """Before the first step (and before the evaluation that precedes it); ``steps_per_epoch``: the schedule's
        (None when no strategy counts epochs)."""

    def step_begin(self, step: int) -> None:
        """Before step ``step`` collects its batch."""

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """After a held-out evaluation at ``step`` (0: before training); ``metrics``: ``eval/*`` names."""

    def step_end(self, step: int, report: StepReport) -> bool:
        """After step ``step`` is logged; True stops training after it (checkpointed first)."""
        return False

    def saved(self, step: int, path: Path) -> None:
        """After the checkpoint of ``step`` is on disk at ``path``."""

    def final_weights(self) -> Path | None:
        """A saved folder whose weights the run ends with instead of its last (Trainer's load_best_model_at_end:
        its best checkpoint), loaded before final/ is written; None: the last weights (or best/, as
        ``train.load_best_at_end`` says)."""
        return None

    def train_end(self, last_step: int) -> None:
        """After the final weights are saved."""


@dataclass
class Loop:
    """What the skeleton drives, built once by a mode's setup."""

    schedule: Schedule
    update: Callable[[int, RolloutBatch], StepUpdate]  # (step, this rank's batch) -> train statistics
    trainable: Trainable
    tokenizer: object
    out: Path
    info: DistInfo
    logger: MetricsLogger
    progress: AbstractContextManager  # with update(step, metrics): grpo.run.progress
    compute: AbstractContextManager  # the trainer's autocast/attention context (grpo.models.loading)
    group_size: int
    tag_style: str
    save_total_limit: int | None
    # held-out evaluation of the weights of a step (0: before training) -> {set: metrics}; None: no held-out set
    evaluate: Callable[[int], dict | None] | None = None
    best: BestMetric | None = None  # train.best_metric: the best evaluation's weights kept in best/
    critic: object | None = None  # saved in every checkpoint (PPO)
    score: Callable | None = None  # the task's scorer (grpo.tasks.Task.score) for the logged accuracy; None: numeric
    hooks: LoopHooks = field(default_factory=LoopHooks)
    layout: CheckpointLayout = GRPO_LAYOUT  # where checkpoints go (train.checkpoint_layout)
    reference: object | None = None  # a moving reference (loss.ref_sync_steps), saved in every checkpoint
    entropy: EntropyControl | None = None  # the adaptive entropy coefficient (the update's), saved in every checkpoint
    # FSDP2: the sharded models gathered while a block runs passes that differ per rank (an evaluation's)
    gathered: Callable[[], AbstractContextManager] = nullcontext


@dataclass
class RunState:
    """The weights are those of step ``done``, except while a step's update runs (``updating``);
    ``saved`` is the newest checkpoint's step."""

    done: int
    saved: int
    updating: bool = False


@dataclass
class LoopResult:
    last_step: int
    eval_before: dict | None
    eval_after: dict | None


def run_loop(loop: Loop, source: StepSource, start_step: int, eval_before: dict | None = None) -> LoopResult:
    """Train steps ``start_step + 1 .. max_steps`` (evaluating before the first step of a new run and after
    the last), then save the final weights. Ctrl-C: ``KeyboardInterrupt`` after the last finished step is
    checkpointed (unless a second Ctrl-C stopped a step's update midway: then nothing is saved)."""
    loop.hooks.train_begin(start_step, loop.schedule.max_steps, loop.schedule.steps_per_epoch)
    with loop.compute, sigterm_as_interrupt():
        if start_step == 0 and loop.evaluate is not None and loop.schedule.eval_on_start:
            eval_before, evaluated = _evaluate(loop, 0)
            loop.logger.log(0, evaluated)
        last_step = _steps(loop, source, start_step, eval_before)
        eval_after = None
        if loop.evaluate is not None and loop.schedule.eval_at_end:
            eval_after, evaluated = _evaluate(loop, last_step)
            loop.logger.log(last_step, evaluated)
    loop.logger.close()
    _load_final_weights(loop)
    if loop.schedule.save_final:
        final_weights = full_weights(loop.trainable.learner)  # a collective under ZeRO-3 and FSDP2
        if loop.info.is_main:
            save_final(loop.out, loop.trainable.policy, loop.tokenizer, state_dict=final_weights)
    if loop.schedule.plots and loop.info.is_main:
        plot_run(loop.out)
    barrier(loop.info)
    loop.hooks.train_end(last_step)
    return LoopResult(last_step, eval_before, eval_after)


def _load_final_weights(loop: Loop) -> None:
    """Load the weights the run ends with when they are not its last (``LoopHooks.final_weights``, else best/ under
    ``train.load_best_at_end`` once an evaluation kept any), on every rank alike."""
    folder = loop.hooks.final_weights()
    best = loop.best
    if folder is None and loop.schedule.load_best_at_end and best is not None and best.step is not None:
        folder = loop.out / BEST_DIR
    if folder is None:
        return
    load_weights(folder, loop.trainable.policy)
    print0(loop.info, f"loaded the weights the run ends with from {folder}")


def _evaluate(loop: Loop, step: int) -> tuple[dict | None, dict[str, float]]:
    """The held-out evaluation of the weights of ``step``: its results and logged metrics (``eval/*``, passed to
    the hooks, and ``time/eval_s``). With ``train.best_metric``, ``best/`` gets these weights when they are the
    best yet (on every rank alike: the metrics are gathered, and the ZeRO-3 weights are a collective)."""
    started = time.perf_counter()
    with loop.gathered():
        results = loop.evaluate(step)
    metrics = eval_metrics(results)
    seconds = time.perf_counter() - started
    loop.hooks.evaluated(step, {**metrics, "time/eval_s": seconds})
    if loop.best is not None and metrics and loop.best.update(step, metrics):
        weights = full_weights(loop.trainable.learner)
        if loop.info.is_main:
            save_best(loop.out, loop.trainable.policy, loop.tokenizer, step, loop.best.metric, loop.best.value,
                      state_dict=weights)
        barrier(loop.info)
    return results, {**metrics, "time/eval_s": seconds}


def _steps(loop: Loop, source: StepSource, start_step: int, eval_before: dict | None) -> int:
    schedule, info = loop.schedule, loop.info
    state = RunState(done=start_step, saved=start_step)
    interrupt = DeferredInterrupt()
    # Several ranks stop together, after a step every rank finished (see RankAgreedStop); one rank stops at once.
    agreed = RankAgreedStop() if info.enabled else None
    holding = interrupt.holding if agreed is None else nullcontext
    skips = SkipGuard(schedule.max_skipped_steps, schedule.updates_per_step)

    def checkpoint(step: int, collected: Collected | None) -> None:
        trainer_state = {"step": step, "eval_before": eval_before, **source.checkpoint_state(step, collected),
                         **({"adaptive_entropy": loop.entropy.state_dict()} if loop.entropy is not None else {})}
        path = save_run_checkpoint(loop.out, step, loop.trainable, loop.tokenizer, trainer_state,
                                   loop.save_total_limit, info, loop.critic, loop.layout, loop.reference)
        state.saved = step
        source.checkpoint_written(step, collected)
        loop.hooks.saved(step, path)

    step = start_step
    try:
        with loop.progress, agreed or nullcontext():
            for step in range(start_step + 1, schedule.max_steps + 1):
                started = time.perf_counter()
                loop.hooks.step_begin(step)
                collected = source.collect(step, (lambda: agreed.requested) if agreed else (lambda: False))
                # From the update to the step's checkpoint, Ctrl-C waits for the step to end: the weights then
                # match the step that is logged and saved.
                with holding():
                    state.updating = True
                    update_started = time.perf_counter()
                    stats = loop.update(step, collected.batch)
                    update_s = time.perf_counter() - update_started
                    checkpointing = schedule.checkpoints(step)
                    metrics = _record(loop, source, step, collected, stats.totals, started, update_s, checkpointing)
                    updates = update_metrics(stats.updates, info, collected.rank_share)
                    state.updating, state.done = False, step
                    if checkpointing:
                        checkpoint(step, collected)
                skips.record(step, stats.totals)
                stop = loop.hooks.step_end(step, StepReport(metrics, updates, collected.batch))
                if schedule.stops_early(metrics):
                    print0(info, f"{schedule.early_stop_metric} {metrics[schedule.early_stop_metric]:.3f} reached "
                                 f"{schedule.early_stop_accuracy}: stopping")
                if stop or schedule.stops_early(metrics):
                    _close_stopped_epoch(loop, step)
                    if not checkpointing and schedule.saves:
                        checkpoint(step, None)
                    break
                if agreed is not None and any(all_gather_json(agreed.requested, info)):
                    print0(info, f"\ninterrupted: every rank stops after step {step}" + ", saved" * schedule.saves)
                    if not checkpointing and schedule.saves:
                        checkpoint(step, None)
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        # The step in flight is lost, never saved under another step's number (its batch would then be
        # trained twice after resuming).
        if state.updating or interrupt.forced or (agreed is not None and agreed.forced):
            print0(info, f"\ninterrupted during the update of step {state.done + 1}: nothing saved; --resume "
                         f"continues from step {state.saved}")
        elif state.done > state.saved and schedule.saves:
            print0(info, f"\ninterrupted: saving a checkpoint of step {state.done}")
            checkpoint(state.done, None)
        loop.logger.close()
        raise
    return step


def _close_stopped_epoch(loop: Loop, step: int) -> None:
    """Training stopped inside an epoch (a callback, early stopping): Trainer still closes it, so an epoch
    evaluation strategy evaluates this step (under ``eval_at_end`` the evaluation after the loop does)."""
    schedule = loop.schedule
    if (schedule.eval_strategy == EPOCH and not schedule.evaluates(step) and not schedule.eval_at_end
            and loop.evaluate is not None):
        loop.logger.log(step, _evaluate(loop, step)[1])


def _record(loop: Loop, source: StepSource, step: int, collected: Collected, stats: dict, started: float,
            update_s: float, checkpointing: bool) -> dict[str, float]:
    """After a step's update: the mode's own work (``after_update``), evaluation when due, then the step's
    metrics and samples logged and the progress shown. Returns the metrics."""
    metrics = step_metrics(collected.batch, stats, loop.group_size, loop.tag_style, started, collected.rollout_s,
                           update_s, loop.info, collected.rollout_stats, score=loop.score,
                           rank_share=collected.rank_share)
    metrics.update(collected.metrics)
    metrics.update(source.after_update(step, collected, checkpointing))
    if loop.schedule.evaluates(step) and loop.evaluate is not None:
        metrics.update(_evaluate(loop, step)[1])
    loop.logger.log(step, metrics)
    if loop.schedule.writes_samples(step):
        loop.logger.log_samples(step, sample_records(collected.batch, loop.schedule.num_samples))
    loop.progress.update(step, metrics)
    return metrics
