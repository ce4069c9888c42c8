"""An evaluation's metrics as the log entries TRL's Trainer makes of them: ``{prefix}_reward``,
``{prefix}_rewards/<fn>/mean``, ``{prefix}_completions/*`` under TRL's names for every set alike, the set's own
``{prefix}_<set>_runtime`` and grpo's ``{prefix}_<set>_accuracy``, ``..._pass@k``, one entry per eval set."""

from __future__ import annotations

import math


# grpo's evaluation metric (of a set) -> TRL's evaluation name, after the prefix
TRL_EVAL_NAMES = {
    "reward/total": "reward", "reward_std/total": "reward_std", "truncated_rate": "completions/clipped_ratio",
    "completion_length/mean": "completions/mean_length", "completion_length/min": "completions/min_length",
    "completion_length/max": "completions/max_length",
    "terminated_length/mean": "completions/mean_terminated_length",
    "terminated_length/min": "completions/min_terminated_length",
    "terminated_length/max": "completions/max_terminated_length",
    "tools/calls_per_completion": "tools/call_frequency", "tools/failure_rate": "tools/failure_frequency",
    # the loss pass's (grpo.training.eval_loss), which TRL's log prefixes eval_ whatever the set; the loss itself
    # keeps the set's prefix (Trainer's metric_key_prefix): eval_loss, eval_<set>_loss
    **{name: name for name in ("entropy", "kl", "frac_reward_zero_std", "clip_ratio/low_mean", "clip_ratio/low_min",
                               "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean")},
}


def eval_set_metrics(metrics: dict[str, float], set_names: list[str]) -> dict[str, dict[str, float]]:
    """An evaluation's ``eval/*`` metrics (``grpo.training.evaluator.eval_metrics``) by set: ``{set: {name after
    the set: value}}``; the unnamed set (``""``) takes every ``eval/<name>``."""
    by_set: dict[str, dict[str, float]] = {name: {} for name in set_names}
    for name, value in metrics.items():
        if not name.startswith("eval/"):
            continue
        rest = name[len("eval/"):]
        head, _, tail = rest.partition("/")
        if "" in by_set:
            by_set[""][rest] = value
        elif tail and head in by_set:
            by_set[head][tail] = value
    return by_set


def _named_sets(metrics: dict[str, float]) -> list[str]:
    """The named sets an evaluation's metrics hold (each has its own ``eval/<set>/accuracy``)."""
    heads = dict.fromkeys(name.split("/")[1] for name in metrics if name.startswith("eval/") and name.count("/") > 1)
    return [head for head in heads if f"eval/{head}/accuracy" in metrics]


def trl_eval_entries(metrics: dict[str, float], set_rows: dict[str, int], batch_size: int,
                     prefix: str = "eval") -> list[dict[str, float]]:
    """An evaluation's ``eval/*`` metrics (``time/eval_s`` its seconds) as the log entries Trainer.evaluate makes,
    one per set of ``set_rows`` (``{set: rows}``; ``""``: the one unnamed set), in its order.

    Each entry holds what TRL's GRPO evaluation logs, under ``{prefix}_`` for every set alike (TRL's ``log`` adds
    ``eval_`` to its own metrics, whatever the set): ``reward``, ``reward_std``, ``rewards/<fn>/mean|std``,
    ``completions/*``, ``tools/*``; and under the set's own prefix ``{prefix}_<set>_`` (Trainer's
    ``metric_key_prefix`` for a dict of sets) ``runtime``, ``samples_per_second`` and ``steps_per_second``
    (rows in batches of ``batch_size``, as Trainer counts them) and grpo's own (accuracy, pass@k, ...), as a
    ``compute_metrics`` result would be. The sets share generation calls, so a set's runtime is its rows' share
    of the evaluation's seconds. No ``set_rows`` (the config's own ``data.eval``, through ``grpo_overrides``): the
    sets the metrics name, their rows unknown (rates 0, the seconds shared evenly)."""
    set_rows = set_rows or dict.fromkeys(_named_sets(metrics) or [""], 0)
    seconds, total = metrics.get("time/eval_s"), sum(set_rows.values())
    entries = []
    for set_name, rest_values in eval_set_metrics(metrics, list(set_rows)).items():
        own = f"{prefix}_{set_name}" if set_name else prefix
        entry = {}
        for rest, value in rest_values.items():
            key = TRL_EVAL_NAMES.get(rest)
            if key is None and rest.startswith("reward/"):
                key = f"rewards/{rest[len('reward/'):]}/mean"
            elif key is None and rest.startswith("reward_std/"):
                key = f"rewards/{rest[len('reward_std/'):]}/std"
            entry[f"{prefix}_{key}" if key else f"{own}_{rest}"] = value
        if seconds:
            rows = set_rows[set_name]
            runtime = seconds * (rows / total if total else 1 / len(set_rows))
            entry[f"{own}_runtime"] = round(runtime, 4)
            entry[f"{own}_samples_per_second"] = round(rows / runtime, 3)
            entry[f"{own}_steps_per_second"] = round(math.ceil(rows / max(batch_size, 1)) / runtime, 3)
        entries.append(entry)
    return entries
