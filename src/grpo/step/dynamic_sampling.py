"""DAPO's dynamic sampling (``rollout.dynamic_sampling``): drop the groups whose rewards are all equal and
sample more prompts until the step's batch is full.

Why: a group whose ``G`` rewards are equal has a zero advantage under every group estimator (grpo, rloo,
reinforce_pp), so it gives no policy gradient, yet it fills rows of the batch and, with token- or
row-mean losses, dilutes the gradient of the groups that do carry signal. As a policy improves more
groups are all-correct (or all-wrong), and the effective batch shrinks (DAPO, Yu et al. 2025, §3.2).

Rounds (one rank, one step): round 0 is the rank's ordinary prompts and seed; round ``k`` samples
``P/W`` further prompts (``PromptSampler.extra_indices``) with seed ``step_seed(.., k)``. Every round
is a full rank share, as verl's generation batches are, rather than only the missing groups: each
``generate`` call then has the shape of an ordinary step's (hf-static's CUDA graphs and vLLM's batch are
sized for it), rounds do not shrink geometrically while the keep rate stays the same, and each reward
call scores as many completions (so averaging the rounds' ``log_metric`` means is averaging over calls).
Sampling stops at the first round after which the informative groups fill the batch; groups beyond it
are discarded (``rollout/dynamic_groups_surplus``).

The cap (``rollout.dynamic_sampling_max_rounds``, rounds in all, the first included): when it is reached
and the batch is still short, the missing groups are the zero-spread groups drawn first (zero
advantage: no policy gradient, only their KL term), counted in ``rollout/dynamic_groups_filled`` and
``rollout/dynamic_cap_hit``, with a warning. Not a smaller batch: every rank must run the same
micro-batches (DDP reduces gradients per update) and the loss normalisation would change with the
rewards. Not an error (verl raises): late in training most prompts may be solved, and one step's
shortfall is no reason to lose the run.

No collective happens here: ranks may run different numbers of rounds.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Callable, Sequence

from torch import Tensor

from grpo.step.batching import concat_batches, mean_of_present, select_groups
from grpo.step.records import RolloutBatch


def zero_spread_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[P]`` bool, True where all ``group_size`` rewards of a group are equal (exactly: that is what
    makes its group advantages 0). ``rewards``: ``[N]`` with ``N = P * group_size``, groups contiguous."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped == grouped[:, :1]).all(dim=1)


def choose_groups(zero_spread: Sequence[Tensor], want: int) -> tuple[list[tuple[int, int]], int]:
    """Which ``(round, group)`` pairs make the batch of ``want`` groups, and how many of them are filler.

    ``zero_spread[r]`` is round ``r``'s ``[P_r]`` flags (``zero_spread_groups``). The informative groups come
    first, in the order they were drawn, truncated to ``want``; if there are fewer, the zero-spread groups
    drawn first fill the rest. Raises ValueError when all rounds together hold fewer than ``want`` groups.
    """
    drawn = [(r, g, bool(flag)) for r, flags in enumerate(zero_spread) for g, flag in enumerate(flags.tolist())]
    if len(drawn) < want:
        raise ValueError(f"{len(drawn)} groups were drawn for a batch of {want}")
    informative = [(r, g) for r, g, flat in drawn if not flat][:want]
    filler = [(r, g) for r, g, flat in drawn if flat][:want - len(informative)]
    return informative + filler, len(filler)


def merge_rounds(rounds: Sequence[RolloutBatch], chosen: Sequence[tuple[int, int]], pad_id: int) -> RolloutBatch:
    """The ``chosen`` ``(round, group)`` groups, in that order, as one batch.

    Timings are the sum over every round, the rewards' ``log_metric`` values their mean over every round and
    the rollout's metrics their mean over every round's rows, dropped groups included: they describe the
    work done and what the rewards saw. Rows keep their ``loss_mask`` and messages (``select_groups``)."""
    pieces = [select_groups(rounds[r], [g for _, g in run])
              for r, run in itertools.groupby(chosen, key=lambda pair: pair[0])]
    merged = concat_batches(pieces, pad_id)
    merged.timings = {k: sum(b.timings.get(k, 0.0) for b in rounds) for k in rounds[0].timings}
    names = dict.fromkeys(name for b in rounds for name in b.reward_metrics)
    merged.reward_metrics = {name: sum(b.reward_metrics[name] for b in rounds if name in b.reward_metrics)
                             / sum(name in b.reward_metrics for b in rounds) for name in names}
    # The multi-turn driver's means (tool calls per completion...), likewise over every round's rows.
    merged.generation.rollout_metrics = mean_of_present([b.generation.rollout_metrics for b in rounds],
                                                        [len(b.generation.completions) for b in rounds])
    return merged


def sample_until_full(draw_round: Callable[[int], RolloutBatch], want: int, max_rounds: int,
                      pad_id: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Rounds ``draw_round(0), draw_round(1), ...`` (scored batches) until their informative groups fill
    ``want`` groups or ``max_rounds`` rounds ran; returns the merged batch of exactly ``want`` groups
    (``choose_groups``, ``merge_rounds``) and this rank's counts:

    ``rollout/dynamic_rounds`` rounds sampled; ``rollout/dynamic_prompts_drawn`` prompts sampled in them;
    ``rollout/dynamic_groups_dropped`` zero-spread groups among those; ``rollout/dynamic_groups_surplus``
    informative groups left out (beyond the batch); ``rollout/dynamic_groups_filled`` zero-spread groups
    trained on anyway because the cap was reached; ``rollout/dynamic_cap_hit`` 1.0 when that happened.
    """
    if max_rounds < 1 or want < 1:
        raise ValueError(f"max_rounds and want must be >= 1, got {max_rounds} and {want}")
    rounds: list[RolloutBatch] = []
    flags: list[Tensor] = []
    informative = 0
    while len(rounds) < max_rounds and informative < want:
        batch = draw_round(len(rounds))
        group_size = batch.rewards.shape[0] // len(batch.prompts)
        rounds.append(batch)
        flags.append(zero_spread_groups(batch.rewards, group_size))
        informative += int((~flags[-1]).sum())
    chosen, filled = choose_groups(flags, want)
    if filled:
        warnings.warn("dynamic sampling reached rollout.dynamic_sampling_max_rounds with too few groups whose "
                      "rewards differ: the batch was filled with zero-spread groups (zero advantage; counted in "
                      "rollout/dynamic_groups_filled). Raise the cap, or make the task harder or the reward finer.",
                      RuntimeWarning, stacklevel=2)
    dropped = sum(int(f.sum()) for f in flags)
    stats = {
        "rollout/dynamic_rounds": float(len(rounds)),
        "rollout/dynamic_prompts_drawn": float(sum(len(b.prompts) for b in rounds)),
        "rollout/dynamic_groups_dropped": float(dropped),
        "rollout/dynamic_groups_surplus": float(informative - (want - filled)),
        "rollout/dynamic_groups_filled": float(filled),
        "rollout/dynamic_cap_hit": float(filled > 0),
    }
    return merge_rounds(rounds, chosen, pad_id), stats

