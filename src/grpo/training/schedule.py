"""When the loop checkpoints, evaluates, writes samples and stops: by steps or by epochs (``train.save_strategy``,
``train.eval_strategy``, ``log.logging_strategy``), as transformers' ``DefaultFlowCallback`` decides them.

An epoch is TRL's: ``len(data.train) // train.prompts_per_step`` steps (the prompts that do not fill a last step
are left out of its count; grpo's prompt stream carries them into the next step, ``grpo.data.prompt_sampler``).
Trainer closes an epoch when training stops inside one too (max_steps, a callback), so an epoch strategy also acts
at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

STEPS, EPOCH, NO = "steps", "epoch", "no"


@dataclass(frozen=True)
class Schedule:
    """When the loop checkpoints, evaluates, writes samples, stops (``train.*``, ``log.*``)."""

    max_steps: int
    save_steps: int
    eval_steps: int | None = None
    eval_on_start: bool = True
    eval_at_end: bool = True  # False: the last step is evaluated inside it, before its checkpoint (TRL's rule)
    logging_steps: int = 1
    num_samples: int = 0
    early_stop_accuracy: float | None = None
    early_stop_metric: str = "eval/accuracy"  # named eval sets: the first set's (eval/<first>/accuracy)
    max_skipped_steps: int = 3
    updates_per_step: int = 1  # num_iterations x mini_batches: a step whose every update was skipped is skipped
    save_final: bool = True  # the end: final/ (train.save_final) and plots/ (log.plots)
    plots: bool = True
    save_strategy: str = STEPS
    eval_strategy: str = STEPS
    logging_strategy: str = STEPS
    steps_per_epoch: int | None = None  # needed by an epoch strategy (``epoch_steps``)
    load_best_at_end: bool = False  # train.load_best_at_end: end with best/'s weights

    def __post_init__(self) -> None:
        for name in ("save_strategy", "eval_strategy", "logging_strategy"):
            if getattr(self, name) not in (STEPS, EPOCH, NO):
                raise ValueError(f"{name} must be steps, epoch or no, got {getattr(self, name)!r}")
        if EPOCH in (self.save_strategy, self.eval_strategy, self.logging_strategy) and not self.steps_per_epoch:
            raise ValueError("an epoch strategy needs steps_per_epoch >= 1")

    def ends_epoch(self, step: int) -> bool:
        """Whether Trainer closes an epoch after ``step``: a whole epoch's steps are done, or training ends."""
        return bool(self.steps_per_epoch) and step % self.steps_per_epoch == 0 or step == self.max_steps

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints at all (also those of a stop or Ctrl-C)."""
        return self.save_strategy != NO

    def checkpoints(self, step: int) -> bool:
        if self.save_strategy == EPOCH:
            return self.ends_epoch(step)
        return self.saves and (step % self.save_steps == 0 or step == self.max_steps)

    def evaluates(self, step: int) -> bool:
        if self.eval_strategy == EPOCH:
            due = self.ends_epoch(step)
        elif self.eval_strategy == NO or not self.eval_steps:
            return False
        else:
            due = step % self.eval_steps == 0 or step == self.max_steps  # transformers' DefaultFlowCallback
        if self.eval_at_end:  # the last step is evaluated once, after the loop
            return due and step < self.max_steps
        return due

    def writes_samples(self, step: int) -> bool:
        if not self.num_samples or self.logging_strategy == NO:
            return False
        return self.ends_epoch(step) if self.logging_strategy == EPOCH else step % self.logging_steps == 0

    def stops_early(self, metrics: dict[str, float]) -> bool:
        target = self.early_stop_accuracy
        return target is not None and metrics.get(self.early_stop_metric, -1.0) >= target


def uses_epochs(save_strategy: str, eval_strategy: str, logging_strategy: str) -> bool:
    """Whether any of the strategies counts epochs (the run then needs its training set's size)."""
    return EPOCH in (save_strategy, eval_strategy, logging_strategy)


def epoch_steps(train_size: int, prompts_per_step: int) -> int:
    """TRL's steps per epoch: the prompts that fill whole steps; ValueError when none does."""
    if train_size < prompts_per_step:
        raise ValueError(f"an epoch strategy counts epochs of data.train, whose {train_size} prompts do not fill one "
                         f"step's {prompts_per_step} (train.prompts_per_step)")
    return train_size // prompts_per_step
