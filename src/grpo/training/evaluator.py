"""Evaluation inside a run: its held-out sets (``data.eval``) at start, every ``train.eval_steps`` and at the
end, through the run's own rollout engine (the one the loop samples with, holding the current weights), scored
by the run's task and rewards, as ``eval.*`` says (greedy, plus k samples).

On N ranks each rank evaluates a contiguous slice of each set; the per-example records are gathered, so every
rank computes the same metrics (those of one process evaluating the whole set: the slices start where the
whole set's generation calls do, so each call holds the same prompts with the same seed). Rank 0 writes the
records to ``<output_dir>/eval/step_<N>/<set>.jsonl``. With ``eval.loss_pass`` each set's loss on sampled groups
is added (``grpo.training.eval_loss``: TRL's ``eval_loss``), its batches sliced over the ranks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import ConfigError, RunConfig
from grpo.evaluation.evaluate import call_unit, evaluate_records, mean_rollout_metrics
from grpo.evaluation.example_records import EvalRewards, logged_metrics, summarize, write_records
from grpo.models.wrappers import unwrap_model
from grpo.multiturn.driver import ExampleRollout
from grpo.parallel.distributed import DistInfo, all_gather_json
from grpo.tasks import Task, run_system_prompt
from grpo.training.eval_loss import LossPass, mean_of_batches

UNNAMED = ""  # the set of a plain ``data.eval`` source: its metrics are eval/accuracy, ... (no set name)
RECORDS_DIR = "eval"


@dataclass(frozen=True)
class EvalSettings:
    """How a run evaluates (``data.*``, ``rollout.max_completion_length``, ``eval.*``), built by ``eval_settings``.

    Without rollout.repetition_penalty / min_new_tokens / min_p: they shape exploration during training, while
    the held-out figures measure the policy itself, comparable across runs that sample differently."""

    task: Task
    tag_style: str
    system_prompt: str | None
    add_system_prompt: bool
    batch_size: int  # completions per generation call
    max_new_tokens: int
    max_prompt_length: int
    samples: int  # k (1: greedy only)
    temperature: float
    bootstrap: int
    seed: int
    save_records: bool
    max_written: int


def eval_settings(cfg: RunConfig, task: Task, world_size: int = 1) -> EvalSettings:
    """How a run with ``task`` (its own, resolved once: ``grpo.training.inputs``) evaluates on ``world_size`` ranks."""
    e = cfg.eval
    # By default a call holds what a training step generates at once on a rank: it fits, and fewer, fuller
    # calls cost less than many small ones (each decode step's fixed cost is paid per call).
    step_rows = (cfg.rollout.generation_batch_size
                 or cfg.train.prompts_per_step * cfg.rollout.num_generations // world_size)
    return EvalSettings(task=task, tag_style=cfg.data.tag_style, system_prompt=run_system_prompt(cfg, task),
                        add_system_prompt=cfg.data.add_system_prompt,
                        batch_size=e.batch_size or max(step_rows, 16),
                        max_new_tokens=cfg.rollout.max_completion_length,
                        max_prompt_length=cfg.data.max_prompt_length, samples=e.num_samples,
                        temperature=e.temperature, bootstrap=e.bootstrap, seed=cfg.train.seed,
                        save_records=e.save_records, max_written=e.max_samples_written)


def eval_sources(value: str | dict[str, str] | None) -> dict[str, str]:
    """``data.eval`` as ``{set name: source}``: a plain source is the one unnamed set; null none."""
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else {UNNAMED: value}


def rank_example_range(size: int, unit: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of this rank's contiguous slice of ``size`` examples, cut at multiples of ``unit``
    (whole generation calls), the calls shared out as evenly as they go."""
    calls = -(-size // unit)
    first, last = calls * rank // world_size, calls * (rank + 1) // world_size
    return min(first * unit, size), min(last * unit, size)


@dataclass
class RunEvaluator:
    """The run's evaluation, called with the step whose weights it measures (0: before training); returns
    ``{set name: metrics}`` (``eval_scoring.summarize``'s, plus multi-turn tool metrics), the same on every rank.
    Built by ``grpo.training.prepare.build_evaluator``.

    ``engine``: the run's rollout engine (multi-turn when the run has tools; a rollout hook's engine is the one
    it wraps, as a hook's rollouts are the user's); ``policy``: its module (for the RNG streams kept untouched)."""

    settings: EvalSettings
    sets: dict[str, list]
    engine: object
    policy: torch.nn.Module
    tokenizer: object
    info: DistInfo
    rewards: EvalRewards | None = None
    out: Path | None = None  # the run folder the records go to (None: not written)
    loss_pass: LossPass | None = None  # eval.loss_pass: each set's loss on sampled groups (TRL's eval_loss)

    def __post_init__(self) -> None:
        # Checked on every rank for the whole sets: a rank whose slice failed alone would leave the others
        # waiting in the gather.
        for name, examples in self.sets.items():
            label = f"data.eval set {name!r}" if name else "data.eval"
            if not examples:
                raise ConfigError(f"{label}: no examples")
            unanswered = [e.source for e in examples if e.answer is None]
            if unanswered:
                raise ConfigError(f"{label}: {len(unanswered)} example(s) have no gold answer, e.g. "
                                  f"{unanswered[0]}; evaluation needs an answer column")

    def __call__(self, step: int) -> dict[str, dict]:
        s = self.settings
        unit = call_unit(s.batch_size, s.samples)
        # The sets share generation calls (fewer, fuller calls), except multi-turn, whose per-call tool metrics
        # belong to one set.
        together = not isinstance(self.engine, ExampleRollout)
        results = {}
        for names in [list(self.sets)] if together else [[name] for name in self.sets]:
            examples = [e for name in names for e in self.sets[name]]
            start, end = rank_example_range(len(examples), unit, self.info.rank, self.info.world_size)
            records, chunks = evaluate_records(
                unwrap_model(self.policy), self.tokenizer, examples[start:end], task=s.task, tag_style=s.tag_style,
                system_prompt=s.system_prompt, add_system_prompt=s.add_system_prompt, batch_size=s.batch_size,
                max_new_tokens=s.max_new_tokens, samples=s.samples, temperature=s.temperature, seed=s.seed,
                progress=False, engine=self.engine, max_prompt_length=s.max_prompt_length, rewards=self.rewards,
                max_written=s.max_written, first_example=start)
            parts = all_gather_json({"records": records, "chunks": chunks}, self.info)
            gathered = [r for part in parts for r in part["records"]]
            chunks = [c for part in parts for c in part["chunks"]]
            for name in names:  # each set's records, in the order the sets were joined
                records, gathered = gathered[:len(self.sets[name])], gathered[len(self.sets[name]):]
                results[name] = {**summarize(records, s.samples, s.bootstrap, s.seed), **mean_rollout_metrics(chunks)}
                if s.save_records and self.out is not None and self.info.is_main:
                    write_records(self.out / RECORDS_DIR / f"step_{step}" / f"{name or 'eval'}.jsonl", records)
        if self.loss_pass is not None:
            for name, examples in self.sets.items():
                results[name].update(self._loss(examples, step))
        return results

    def _loss(self, examples: list, step: int) -> dict[str, float]:
        """The loss pass over one set: this rank's slice (whole batches), every rank's batches averaged."""
        unit = self.loss_pass.settings.prompts_per_batch
        start, end = rank_example_range(len(examples), unit, self.info.rank, self.info.world_size)
        batches = self.loss_pass(examples[start:end], step, first_example=start)
        return mean_of_batches([b for part in all_gather_json(batches, self.info) for b in part])


def eval_metrics(results: dict[str, dict] | None) -> dict[str, float]:
    """The logged names of an evaluation's metrics: ``eval/accuracy``, ``eval/pass@4``, ``eval/reward/<name>``,
    ``eval/accuracy/people=3``, ``eval/tools/*`` for the unnamed set; ``eval/<set>/...`` for named ones (empty
    for None)."""
    return logged_metrics(results) if results else {}


def primary_result(results: dict[str, dict] | None) -> dict | None:
    """The first set's metrics (the before/after summary's and early stopping's), or None."""
    if results and "accuracy" in results:  # one set's metrics, as a checkpoint from before named sets saved them
        return results
    return next(iter(results.values())) if results else None


def primary_metric(sets: dict[str, str] | dict[str, list], metric: str = "accuracy") -> str:
    """The logged name of ``metric`` of the first set: ``eval/accuracy`` or ``eval/<first>/accuracy``."""
    first = next(iter(sets), UNNAMED)
    return f"eval/{first}/{metric}" if first else f"eval/{metric}"
