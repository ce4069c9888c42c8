"""Evaluation's scoring, apart from generation: one JSON-ready record per example from its completions (the
task's scorer, the run's rewards), and the metrics of a list of records.

Records are plain data so that ranks can evaluate slices of a set and gather them (``all_gather_json``):
the metrics of the gathered records are those of one process scoring the whole set. A record holds what
the metrics need (greedy: ``correct``, ``formatted``, ``truncated``, ``group``, ``rewards``, ``task_metrics``;
k samples: ``sample_correct`` and ``sample_formatted`` counts, ``majority_correct``) and what a reader wants
(source, question, gold, the greedy completion, its prediction, up to ``max_written`` sampled completions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.data import Example
from grpo.evaluation.sample_metrics import bootstrap_interval, default_ks, majority_answer, pass_at_k, sample_std
from grpo.rewards.context import RewardContext
from grpo.rewards.scoring import score
from grpo.tasks import Task

BOOTSTRAP_LEVEL = 0.95


@dataclass(frozen=True)
class EvalRewards:
    """The reward functions evaluation applies to the greedy completions (the run's: ``build_rewards``) and
    their weights; ``reward/<name>`` and the weighted ``reward/total`` are their means."""

    functions: Sequence  # RewardFunction (or TRL-style callables)
    weights: Sequence[float]


@dataclass
class RewardInputs:
    """What the rewards see of the greedy completions, [P] each, as training passes it (chat messages, or
    strings for plain-text prompts; ``columns``: the dataset's, plus per-row keywords such as environments)."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    columns: dict[str, list]


def reward_values(rewards: EvalRewards, inputs: RewardInputs) -> list[dict[str, float | None]]:
    """Per example: each reward function's value (None where it abstained) and the weighted ``total``."""
    scores = score(rewards.functions, rewards.weights, inputs.prompts, inputs.completions, inputs.columns,
                   inputs.completion_ids, RewardContext())
    rows = []
    for i in range(len(inputs.completions)):
        row: dict[str, float | None] = {}
        for f, name in enumerate(scores.names):
            value = float(scores.per_function[i, f])
            row[name] = None if math.isnan(value) else value
        row["total"] = float(scores.total[i])
        rows.append(row)
    return rows


def example_records(task: Task, examples: Sequence[Example], tag_style: str, greedy_texts: Sequence[str],
                    greedy_truncated: Sequence[bool], sample_texts: Sequence[str], samples: int,
                    rewards: Sequence[dict] | None = None, max_written: int | None = None,
                    greedy_lengths: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One record per example (module docstring).

    Args:
        greedy_texts, greedy_truncated: [P] the greedy completion of each example (its final answer text).
        sample_texts: [P * samples] the sampled completions, grouped per example; empty when samples == 1.
        rewards: [P] ``reward_values`` of the greedy completions, or None (no rewards).
        max_written: sampled completions kept in a record (None: all).
        greedy_lengths: [P] the greedy completions' token counts (``length``), or None.
    """
    records = []
    for i, example in enumerate(examples):
        gold = example.answer
        greedy = task.score(greedy_texts[i], gold, tag_style)
        record: dict[str, Any] = {
            "source": example.source, "question": example.question, "gold": gold,
            "group": task.group_of(example) if task.group_of is not None else None,
            "completion": greedy_texts[i], "prediction": greedy["prediction"], "correct": bool(greedy["correct"]),
            "formatted": bool(greedy["formatted"]), "truncated": bool(greedy_truncated[i]),
        }
        if greedy_lengths is not None:
            record["length"] = int(greedy_lengths[i])
        if task.metrics is not None:
            record["task_metrics"] = dict(task.metrics(greedy_texts[i], gold, tag_style))
        if rewards is not None:
            record["rewards"] = rewards[i]
        if samples > 1:
            texts = list(sample_texts[i * samples:(i + 1) * samples])
            scores = [task.score(t, gold, tag_style) for t in texts]
            majority = majority_answer([s["prediction"] for s in scores], task.same_answer)
            record.update({
                "sample_correct": sum(bool(s["correct"]) for s in scores),
                "sample_formatted": sum(bool(s["formatted"]) for s in scores),
                "majority": majority,
                # the vote's answer is one of the samples' predictions: correct when a sample with it is
                "majority_correct": majority is not None and any(
                    s["correct"] and task.same_answer(s["prediction"], majority) for s in scores),
                "sample_completions": texts if max_written is None else texts[:max_written],
            })
        records.append(record)
    return records


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize(records: Sequence[dict[str, Any]], samples: int = 1, bootstrap: int = 0,
              seed: int = 0) -> dict[str, float]:
    """The metrics of ``example_records``' records (of one set):

    ``n``; ``accuracy``, ``format_rate``, ``truncated_rate`` of the greedy completions; ``accuracy/<group>`` per
    task group (K&K: ``accuracy/people=3``); the task's own metrics' means; ``reward/<name>`` and
    ``reward/total`` means (over the examples where a reward did not abstain); with k = ``samples`` > 1:
    ``mean@k``, unbiased ``pass@j`` (j = 1, 2, 4 .. k), ``maj@k``, ``mean_sample_accuracy`` (= mean@k) and
    ``sample_format_rate``; with ``bootstrap`` > 0 resamples: a 95% percentile interval ``<metric>_ci_low`` /
    ``<metric>_ci_high`` of accuracy, pass@j and maj@k over the problems."""
    if not records:
        raise ValueError("summarize: no records")
    n = len(records)
    correct = [float(r["correct"]) for r in records]
    metrics: dict[str, float] = {
        "n": n,
        "accuracy": _mean(correct),
        "format_rate": _mean([float(r["formatted"]) for r in records]),
        "truncated_rate": _mean([float(r["truncated"]) for r in records]),
    }
    per_problem: dict[str, list[float]] = {"accuracy": correct}
    groups: dict[str, list[float]] = {}
    for r in records:
        if r.get("group") is not None:
            groups.setdefault(r["group"], []).append(float(r["correct"]))
    for label in sorted(groups):
        metrics[f"accuracy/{label}"] = _mean(groups[label])
    for name in sorted({k for r in records for k in r.get("task_metrics", {})}):
        metrics[name] = _mean([r["task_metrics"][name] for r in records if name in r.get("task_metrics", {})])
    reward_names = list(dict.fromkeys(k for r in records for k in r.get("rewards", {})))
    for name in reward_names:
        values = [r["rewards"][name] for r in records if r.get("rewards", {}).get(name) is not None]
        if values:
            metrics[f"reward/{name}"] = _mean(values)
            metrics[f"reward_std/{name}"] = sample_std(values)
    metrics.update(length_metrics(records))
    if samples > 1:
        counts = [r["sample_correct"] for r in records]
        metrics[f"mean@{samples}"] = sum(counts) / (n * samples)
        for k in default_ks(samples):
            per_problem[f"pass@{k}"] = [pass_at_k(samples, c, k) for c in counts]
            metrics[f"pass@{k}"] = _mean(per_problem[f"pass@{k}"])
        per_problem[f"maj@{samples}"] = [float(r["majority_correct"]) for r in records]
        metrics[f"maj@{samples}"] = _mean(per_problem[f"maj@{samples}"])
        metrics["mean_sample_accuracy"] = metrics[f"mean@{samples}"]  # the name before mean@k
        metrics["sample_format_rate"] = sum(r["sample_formatted"] for r in records) / (n * samples)
    if bootstrap > 0:
        for name, values in per_problem.items():
            low, high = bootstrap_interval(values, draws=bootstrap, level=BOOTSTRAP_LEVEL, seed=seed)
            metrics[f"{name}_ci_low"], metrics[f"{name}_ci_high"] = low, high
    return metrics


def length_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``completion_length/{mean,min,max}`` of the records' greedy completions (tokens) and
    ``terminated_length/{mean,min,max}`` of those that ended (all 0 when none did, as TRL logs them); {} when
    the records carry no ``length``."""
    lengths = [r["length"] for r in records if "length" in r]
    if not lengths:
        return {}
    ended = [r["length"] for r in records if "length" in r and not r["truncated"]] or [0]
    return {"completion_length/mean": _mean(lengths), "completion_length/min": float(min(lengths)),
            "completion_length/max": float(max(lengths)), "terminated_length/mean": _mean(ended),
            "terminated_length/min": float(min(ended)), "terminated_length/max": float(max(ended))}


def logged_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The metrics of several sets' results under the names a run logs: ``eval/<metric>`` for the one unnamed
    set (name ""), ``eval/<set>/<metric>`` for named ones (``n`` and non-numbers left out)."""
    metrics = {}
    for name, result in results.items():
        prefix = f"eval/{name}/" if name else "eval/"
        metrics.update({prefix + key: float(value) for key, value in result.items()
                        if key != "n" and isinstance(value, (int, float)) and not isinstance(value, bool)})
    return metrics


def write_records(path: Path, records: list[dict]) -> None:
    """One JSON line per record (a reward that abstained is null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
