"""What a step reports about its rollouts: reward, accuracy, lengths, signal; and sample records."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from grpo.errors import RewardError
from grpo.evaluation.sample_metrics import sample_std
from grpo.parallel.distributed import DistInfo, all_gather_json, all_reduce_mean
from grpo.rewards import answers_equal, extract_answer, is_well_formatted
from grpo.step.records import RolloutBatch, UpdateStats

# Statistics only some runs have, averaged over ranks: grpo.critic.train_critic's (PPO), the PTX loss, the sampler
# correction's, an MoE policy's load-balancing loss, fp16's loss scale and overflow count, and with an entropy
# bonus the loss without it and the coefficient (the same on every rank).
OPTIONAL_PREFIXES = ("critic/", "loss/value", "loss/ptx", "sampler_is/", "mismatch/", "moe/", "fp16/", "policy_loss",
                     "entropy_coef")
# Of those, the maxima: the largest over the ranks, not their mean.
RANK_MAXIMA = ("mismatch/ratio_max",)
# Averaged over ranks plainly whatever each rank's share of the step: the policy loss is already the rank's part
# of the step's (DDP's mean; grpo.step.policy_update scales it), the PTX batch is the same size on every rank.
RANK_PLAIN_MEANS = ("loss", "loss/ptx", "fp16/loss_scale", "fp16/overflow_updates")  # fp16's: one for every rank
# A task's answer scorer (grpo.tasks.Task.score): (text, gold, tag_style) -> {"correct", "formatted", ...}
Scorer = Callable[[str, str, str], dict]


def rollout_metrics(batch: RolloutBatch, correct: torch.Tensor, formatted: torch.Tensor,
                    group_size: int) -> dict[str, float]:
    """This rank's rollout metrics (means over its completions; rank-averaging is the caller's).

    ``reward/mean_sq`` is carried so the caller can form the std over all ranks. A multi-turn batch
    (``loss_mask`` set) also reports ``sampled_length/*``: the model's own tokens per completion, where
    ``completion_length/*`` counts the environment's too.
    """
    rewards = batch.rewards.double()
    generation = batch.generation
    lengths = generation.completion_mask.sum(dim=1).double()  # [N]
    grouped = rewards.view(-1, group_size)  # [P, G]
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/mean_sq": (rewards ** 2).mean().item(),
        "accuracy": correct.double().mean().item(),
        "format_rate": formatted.double().mean().item(),
        "completion_length/mean": lengths.mean().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": batch.generation.truncated.double().mean().item(),
        "zero_std_fraction": (grouped == grouped[:, :1]).all(dim=1).double().mean().item(),
        "advantage/abs_mean": _masked_mean(batch.advantages.abs().double(), generation.sampled_mask),
    }
    if generation.loss_mask is not None:
        sampled = generation.loss_mask.sum(dim=1).double()  # [N]
        metrics.update({"sampled_length/mean": sampled.mean().item(), "sampled_length/max": sampled.max().item()})
    for f, name in enumerate(batch.reward_names):
        column = batch.reward_parts[:, f]
        valid = column[~torch.isnan(column)]
        metrics[f"reward/{name}"] = valid.double().mean().item() if valid.numel() else math.nan
    return metrics


def step_metrics(batch: RolloutBatch, train_stats: dict, group_size: int, tag_style: str, started: float,
                 rollout_s: float, train_s: float, info: DistInfo,
                 rollout_stats: dict[str, float] | None = None, score: Scorer | None = None,
                 rank_share: float = 1.0) -> dict[str, float]:
    """Everything a step logs, averaged over ranks, each weighted by ``rank_share`` (its rows over the mean rows
    per rank: 1.0 when every rank holds as many completions) except ``RANK_PLAIN_MEANS``; minima, maxima and
    spreads over every rank's rows pooled (``spread_metrics``).

    ``started`` is the step's ``time.perf_counter()`` start; ``rollout_s``/``train_s`` its two phases;
    ``rollout_stats`` this rank's numbers about how its batch was made (dynamic sampling's counts), averaged
    over ranks with the rest (every rank must give the same names); ``score``: the run's task's scorer
    (``grpo.tasks.Task.score``) for accuracy and format rate, as ``correctness`` takes it.
    """
    correct, formatted = correctness(batch.generation.completions, batch.columns.get("answer", []), tag_style,
                                     score)
    local = rollout_metrics(batch, correct, formatted, group_size)
    local.update({k: train_stats[k] for k in ("loss", "kl", "clip_fraction", "ratio_mean", "entropy")})
    local.update({k: v for k, v in train_stats.items() if k.startswith(OPTIONAL_PREFIXES)})  # critic, PTX, IS
    local.update(rollout_stats or {})
    local.update(batch.generation.rollout_metrics)  # multi-turn: tools/calls_per_completion, ... (every rank)
    keys = sorted(local)
    weighted = [local[k] * (1.0 if k in RANK_PLAIN_MEANS else rank_share) for k in keys]
    averaged = all_reduce_mean(torch.tensor(weighted, dtype=torch.float64), info)
    metrics = dict(zip(keys, averaged.tolist()))
    maxima = [k for k in RANK_MAXIMA if k in local]  # every rank has the same names
    if maxima:
        metrics.update(dict(zip(maxima, map(max, zip(*all_gather_json([local[k] for k in maxima], info))))))
    # reward/std over all ranks from the averaged first and second moments
    metrics["reward/std"] = max(metrics.pop("reward/mean_sq") - metrics["reward/mean"] ** 2, 0.0) ** 0.5
    step_s = time.perf_counter() - started
    completion_tokens = float(batch.generation.completion_mask.sum()) * info.world_size
    metrics.update({
        "learning_rate": train_stats["learning_rate"], "grad_norm": train_stats["grad_norm"],
        "skipped_updates": train_stats["skipped_updates"],
        "time/rollout_s": rollout_s, "time/train_s": train_s, "time/step_s": step_s,
        "tokens_per_s": completion_tokens / step_s,
        **{f"time/{name}": seconds for name, seconds in batch.timings.items()},
    })
    metrics.update(spread_metrics(all_gather_json(spread_inputs(batch), info)))
    metrics.update(reward_logged_metrics(batch.reward_metrics, set(metrics), info))
    return metrics


def spread_inputs(batch: RolloutBatch) -> dict:
    """What ``spread_metrics`` needs of this rank's batch, as JSON: per row the completion length, the
    sampled length (the model's own tokens), the truncation flag and each reward (None where it abstained),
    and the prompt tokens."""
    generation = batch.generation
    parts = batch.reward_parts.double()
    return {"lengths": generation.completion_mask.sum(dim=1).tolist(),
            "sampled": generation.sampled_mask.sum(dim=1).tolist(),
            "truncated": generation.truncated.tolist(),
            "rewards": [[None if math.isnan(v) else v for v in row] for row in parts.tolist()],
            "names": list(batch.reward_names),
            "prompt_tokens": int(generation.prompt_mask.sum())}


def spread_metrics(per_rank: Sequence[dict]) -> dict[str, float]:
    """Minima, maxima and spreads over every rank's rows (``spread_inputs`` of each), as TRL 1.16 computes
    them over the gathered batch: ``completion_length/{min,max}``; ``terminated_length/{mean,min,max}`` of the
    completions that ended (their sampled tokens; all 0 when none did, as TRL); ``sampled_length/{min,max}``
    multi-turn (when a row's sampled tokens differ from its tokens); ``reward_std/<name>`` the sample std
    (Bessel) of each reward where it did not abstain (NaN with fewer than 2 values); ``step_tokens`` the
    prompt tokens of every completion row plus the sampled completion tokens."""
    lengths = [x for r in per_rank for x in r["lengths"]]
    sampled = [x for r in per_rank for x in r["sampled"]]
    truncated = [x for r in per_rank for x in r["truncated"]]
    ended = [n for n, cut in zip(sampled, truncated) if not cut] or [0]
    metrics = {"completion_length/min": float(min(lengths)), "completion_length/max": float(max(lengths)),
               "terminated_length/mean": sum(ended) / len(ended), "terminated_length/min": float(min(ended)),
               "terminated_length/max": float(max(ended)),
               "step_tokens": float(sum(r["prompt_tokens"] for r in per_rank) + sum(sampled))}
    if sampled != lengths:
        metrics.update({"sampled_length/min": float(min(sampled)), "sampled_length/max": float(max(sampled))})
    rows = [row for r in per_rank for row in r["rewards"]]
    for f, name in enumerate(per_rank[0]["names"]):
        metrics[f"reward_std/{name}"] = sample_std([row[f] for row in rows if row[f] is not None])
    return metrics


def reward_logged_metrics(local: dict[str, float], taken: set[str], info: DistInfo) -> dict[str, float]:
    """What reward functions gave ``log_metric``, averaged over the ranks that logged each name (ranks
    may log different names), under the name itself as TRL logs it. A name that grpo logs itself
    would overwrite a real metric: RewardError."""
    clashes = sorted(set(local) & taken)
    if clashes:
        raise RewardError(f"a reward's log_metric used the names {clashes}, which grpo logs itself; choose "
                          f"other names (e.g. 'rewards/{clashes[0]}')")
    per_rank = all_gather_json(local, info)
    names = dict.fromkeys(name for logged in per_rank for name in logged)
    return {name: sum(r[name] for r in per_rank if name in r) / sum(name in r for r in per_rank) for name in names}


def sample_records(batch: RolloutBatch, num_samples: int) -> list[dict]:
    """The first ``num_samples`` completions with their prompt, gold answer and rewards. A multi-turn completion
    is its messages (assistant turns with their ``tool_calls``, the ``tool`` results), as TRL logs it, and its
    decoded tokens are ``completion_text``."""
    def column(name: str, row: int):
        values = batch.columns.get(name)
        return values[row] if values is not None else None

    messages = batch.generation.messages
    records = []
    for row in range(min(num_samples, len(batch.generation.completions))):
        text = batch.generation.completions[row]
        records.append({
            "source": column("source", row),
            "prompt": column("question", row),
            "completion": messages[row] if messages is not None else text,
            **({"completion_text": text} if messages is not None else {}),
            "answer": column("answer", row),
            "reward": float(batch.rewards[row]),
            "rewards": {name: _finite_or_none(batch.reward_parts[row, f])
                        for f, name in enumerate(batch.reward_names)},
            # A per-token advantage row (gae) is reported as its mean over the completion's tokens.
            "advantage": _masked_mean(batch.advantages[row].double(), batch.generation.sampled_mask[row]),
            "truncated": bool(batch.generation.truncated[row]),
            **({"extras": {k: v[row] for k, v in batch.reward_extras.items()}} if batch.reward_extras else {}),
        })
    return records


def _masked_mean(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of [N] outcome advantages, or of [N, Lc] per-token ones (gae) over the sampled tokens of ``mask``."""
    if advantages.dim() == mask.dim():
        return float((advantages * mask).sum() / mask.sum().clamp(min=1))
    return float(advantages.mean())


def _finite_or_none(value: torch.Tensor) -> float | None:
    v = float(value)
    return v if math.isfinite(v) else None


def correctness(completions: Sequence[str], golds: Sequence[str | None], tag_style: str,
                score: Scorer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] bool answer correct, [N] bool well formatted) for logging accuracy and format rate;
    ``golds`` has one gold answer (or None) per completion. ``score(text, gold, tag_style)`` is the task's
    scorer (its ``correct`` and ``formatted``); None: the numeric tasks' check (the tagged answer equals the
    gold as a number). A completion without a gold is not correct, and its format is still checked."""
    if score is None:
        correct = [gold is not None and answers_equal(extract_answer(c, tag_style), gold)
                   for c, gold in zip(completions, golds)]
        formatted = [is_well_formatted(c, tag_style) for c in completions]
        return torch.tensor(correct), torch.tensor(formatted)
    scores = [score(c, gold, tag_style) if gold is not None else None for c, gold in zip(completions, golds)]
    correct = [s is not None and bool(s["correct"]) for s in scores]
    formatted = [bool(s["formatted"]) if s is not None else is_well_formatted(c, tag_style)
                 for c, s in zip(completions, scores)]
    return torch.tensor(correct), torch.tensor(formatted)


def update_metrics(updates: Sequence[UpdateStats], info: DistInfo, rank_share: float = 1.0) -> list[dict[str, float]]:
    """Each optimizer update's metrics over all ranks (``reduce_updates`` of every rank's ``updates``, each with
    the rank's ``rank_share``, as ``step_metrics`` takes it)."""
    return reduce_updates(all_gather_json([{**asdict(u), "rank_share": rank_share} for u in updates], info))


def reduce_updates(per_rank: Sequence[Sequence[dict]]) -> list[dict[str, float]]:
    """Per update, from each rank's ``UpdateStats`` (as dicts; every rank ran the same updates): ``loss``,
    ``kl``, ``entropy``, ``ratio_mean``, ``clip_fraction``, ``vespo_phi_mean`` averaged over ranks, as a step's are
    (weighted by a dict's ``rank_share``, 1.0 when absent, but the losses: ``loss``, ``policy_loss``);
    ``entropy_coef`` rank 0's (None: no bonus); ``clip_ratio/{low,high,region}_mean``
    the clipped units over all ranks' units and ``clip_ratio/low_min`` / ``high_max`` the least / largest row
    share over all rows, NaN-skipping (TRL's ``global_masked_mean``, ``nanmin``, ``nanmax``); ``grad_norm`` (NaN
    when the update was skipped) and ``learning_rate`` as rank 0 has them (the gradients are all-reduced);
    ``update_s`` the slowest rank's seconds."""
    out = []
    for ranks in zip(*per_rank):
        units = sum(r["clip_units"] for r in ranks)
        lows = [r["clip_low_row_min"] for r in ranks if not math.isnan(r["clip_low_row_min"])]
        highs = [r["clip_high_row_max"] for r in ranks if not math.isnan(r["clip_high_row_max"])]
        first = ranks[0]
        out.append({
            "loss": sum(r["loss"] for r in ranks) / len(ranks),
            "policy_loss": sum(r["policy_loss"] for r in ranks) / len(ranks),
            **{name: sum(r[name] * r.get("rank_share", 1.0) for r in ranks) / len(ranks)
               for name in ("kl", "entropy", "ratio_mean", "clip_fraction", "vespo_phi_mean")},
            "entropy_coef": first["entropy_coef"],  # every rank's is the same (the controller reduces over ranks)
            **{f"clip_ratio/{part}_mean": sum(r[f"clip_{part}"] for r in ranks) / units if units else 0.0
               for part in ("low", "high", "region")},
            "clip_ratio/low_min": min(lows) if lows else math.nan,
            "clip_ratio/high_max": max(highs) if highs else math.nan,
            "grad_norm": math.nan if first["grad_norm"] is None else first["grad_norm"],
            "learning_rate": first["learning_rate"],
            "update_s": max(r["seconds"] for r in ranks),
        })
    return out
