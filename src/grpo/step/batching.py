"""Join and split rollout batches along completion rows (a sampler makes one chunk per trainer rank;
each trainer rank trains its own chunk; dynamic sampling keeps some groups of several rounds; a step's
updates take its mini-batches). Groups are never split: rows move in whole prompts."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch


def _pad(tensors: list[Tensor], width: int, value, left: bool) -> Tensor:
    padded = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
              for t in tensors]
    return torch.cat(padded)


def _concat_routing(gens: list[Generation], lp: int, lc: int) -> Tensor | None:
    """The parts' ``routing`` [n_i, Lp_i + Lc_i, layers, k] re-padded as their prompts (left) and completions
    (right) are, with -1 (not recorded); None unless every part has one."""
    if any(g.routing is None for g in gens):
        return None
    parts = []
    for g in gens:
        p, c = g.prompt_ids.shape[1], g.completion_ids.shape[1]
        parts.append(torch.nn.functional.pad(g.routing, (0, 0, 0, 0, lp - p, lc - c), value=-1))
    return torch.cat(parts)


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack batches row-wise: prompts re-padded on the left, completions (and their log-probs) on the
    right, to the widest. Padding is masked, so every row's values are unchanged."""
    gens = [b.generation for b in batches]
    lp = max(g.prompt_ids.shape[1] for g in gens)
    lc = max(g.completion_ids.shape[1] for g in gens)

    def optional(name: str) -> Tensor | None:
        values = [getattr(b, name) for b in batches]
        if any(v is None for v in values):
            return None
        return _pad(values, lc, 0.0, left=False)

    columns: dict[str, list] = {}
    for b in batches:
        for key, values in b.columns.items():
            columns.setdefault(key, []).extend(values)
    return RolloutBatch(
        generation=Generation(
            prompt_ids=_pad([g.prompt_ids for g in gens], lp, pad_id, left=True),
            prompt_mask=_pad([g.prompt_mask for g in gens], lp, 0, left=True),
            completion_ids=_pad([g.completion_ids for g in gens], lc, pad_id, left=False),
            completion_mask=_pad([g.completion_mask for g in gens], lc, 0, left=False),
            truncated=torch.cat([g.truncated for g in gens]),
            completions=[c for g in gens for c in g.completions],
            sampler_logprobs=(None if any(g.sampler_logprobs is None for g in gens)
                              else _pad([g.sampler_logprobs for g in gens], lc, 0.0, left=False)),
            # A single-turn part's sampled tokens are its completion_mask (what sampled_mask says it means).
            loss_mask=(None if all(g.loss_mask is None for g in gens)
                       else _pad([g.sampled_mask for g in gens], lc, 0, left=False)),
            token_versions=(None if any(g.token_versions is None for g in gens)
                            else _pad([g.token_versions for g in gens], lc, 0, left=False)),
            messages=_concat_messages(gens),
            rollout_metrics=mean_of_present([g.rollout_metrics for g in gens],
                                             [g.completion_ids.shape[0] for g in gens]),
            routing=_concat_routing(gens, lp, lc)),
        rewards=torch.cat([b.rewards for b in batches]),
        reward_parts=torch.cat([b.reward_parts for b in batches]),
        reward_names=batches[0].reward_names,
        reward_weights=batches[0].reward_weights,
        advantages=torch.cat([b.advantages for b in batches]),
        old_logprobs=optional("old_logprobs"),
        ref_logprobs=optional("ref_logprobs"),
        sampler_logprobs=optional("sampler_logprobs"),
        values=optional("values"),
        returns=optional("returns"),
        prompts=[p for b in batches for p in b.prompts],
        columns=columns,
        timings={k: sum(b.timings.get(k, 0.0) for b in batches) for k in batches[0].timings},
        reward_metrics=mean_of_present([b.reward_metrics for b in batches]),
        reward_extras={key: [v for b in batches for v in b.reward_extras.get(key, [None] * len(b.rewards))]
                       for key in dict.fromkeys(k for b in batches for k in b.reward_extras)},
        chat_prompts=[p for b in batches for p in b.chat_prompts] if all(b.chat_prompts for b in batches) else [],
        chat_completions=([c for b in batches for c in b.chat_completions]
                          if all(b.chat_completions for b in batches) else []),
    )


def mean_of_present(dicts: list[dict[str, float]], weights: Sequence[float] | None = None) -> dict[str, float]:
    """name -> mean over the dicts that have it (a reward may log a metric in some batches only), weighted
    by ``weights`` (e.g. each batch's rows, for means over rows) when given."""
    weights = [1.0] * len(dicts) if weights is None else weights
    names = dict.fromkeys(k for d in dicts for k in d)
    return {name: sum(w * d[name] for d, w in zip(dicts, weights) if name in d)
            / sum(w for d, w in zip(dicts, weights) if name in d) for name in names}


def _concat_messages(gens: list[Generation]) -> list[list[dict]] | None:
    """The rows' chat messages, or None when no part is multi-turn; a single-turn part's rows become the one
    assistant message their text is (what ``sample_and_score`` gives the rewards for them)."""
    if all(g.messages is None for g in gens):
        return None
    return [m for g in gens
            for m in (g.messages if g.messages is not None
                      else [[{"role": "assistant", "content": c}] for c in g.completions])]


def rank_groups(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    """Rows ``[rank*N/W, (rank+1)*N/W)`` with the matching prompts; N/W must be whole groups."""
    P = len(batch.prompts)
    if P % world_size:
        raise ValueError(f"{P} prompts cannot be split over {world_size} ranks without splitting a group")
    return select_groups(batch, range(rank * P // world_size, (rank + 1) * P // world_size))


def rank_group_spans(num_groups: int, world_size: int) -> list[range]:
    """Each rank's groups (prompt indices, consecutive, in rank order) when ``num_groups`` whole groups are
    split over ``world_size`` ranks as evenly as whole groups allow: the first ``num_groups % world_size``
    ranks hold one more. A decoupled step with partial rollouts holds a varying number of groups (each of its
    W chunks at least one), so it rarely divides evenly; ``rank_groups`` is the even case."""
    if world_size < 1 or num_groups < world_size:
        raise ValueError(f"{num_groups} groups cannot be split over {world_size} ranks: every rank needs at least "
                         "one whole group")
    base, extra = divmod(num_groups, world_size)
    starts = [rank * base + min(rank, extra) for rank in range(world_size + 1)]
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]


def mini_batches(batch: RolloutBatch, count: int) -> list[RolloutBatch]:
    """The batch's groups dealt into ``count`` mini-batches, one optimizer update each (``train.mini_batches``):
    group ``i`` goes to mini-batch ``i % count``; ``[batch]`` itself when ``count`` is 1.

    Whole groups, as verl's ppo_mini_batch_size counts prompts: the advantages were computed over the whole step
    either way, and an update then holds each of its groups' completions side by side (TRL shuffles the
    generation's rows and cuts them, so its updates split groups at random; a run cannot reproduce its draw in
    any case). Dealt rather than cut in runs: dynamic sampling puts its zero-advantage filler groups last, and
    they should not make an update of their own. The rollout's order of prompts is already random."""
    if count == 1:
        return [batch]
    P = len(batch.prompts)
    if P % count:
        raise ValueError(f"train.mini_batches {count} does not divide this rank's {P} prompt groups: each "
                         "mini-batch takes whole groups (with several ranks, each rank's share must divide)")
    return [select_groups(batch, range(index, P, count)) for index in range(count)]


def select_groups(batch: RolloutBatch, groups: Sequence[int]) -> RolloutBatch:
    """The batch's groups ``groups`` (prompt indices, in that order) with all their rows and texts.

    Timings, the rewards' logged metrics and the rollout's (``Generation.rollout_metrics``) describe how the
    whole batch was made and are kept as they are.
    """
    N, P = batch.rewards.shape[0], len(batch.prompts)
    if P == 0 or N % P:
        raise ValueError(f"a batch of {N} rows and {P} prompts is not made of whole groups")
    G = N // P
    rows = [g * G + j for g in groups for j in range(G)]
    index = torch.tensor(rows, dtype=torch.long)
    g = batch.generation

    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[index]

    return RolloutBatch(
        generation=Generation(prompt_ids=cut(g.prompt_ids), prompt_mask=cut(g.prompt_mask),
                              completion_ids=cut(g.completion_ids), completion_mask=cut(g.completion_mask),
                              truncated=cut(g.truncated), completions=[g.completions[r] for r in rows],
                              sampler_logprobs=cut(g.sampler_logprobs), loss_mask=cut(g.loss_mask),
                              token_versions=cut(g.token_versions),
                              messages=None if g.messages is None else [g.messages[r] for r in rows],
                              rollout_metrics=dict(g.rollout_metrics), routing=cut(g.routing)),
        rewards=cut(batch.rewards), reward_parts=cut(batch.reward_parts), reward_names=batch.reward_names,
        reward_weights=batch.reward_weights, advantages=cut(batch.advantages), old_logprobs=cut(batch.old_logprobs), ref_logprobs=cut(batch.ref_logprobs),
        prompts=[batch.prompts[i] for i in groups], columns={k: [v[r] for r in rows] for k, v in batch.columns.items()},
        timings=dict(batch.timings), reward_metrics=dict(batch.reward_metrics),
        reward_extras={k: [v[r] for r in rows] for k, v in batch.reward_extras.items()},
        values=cut(batch.values), returns=cut(batch.returns), sampler_logprobs=cut(batch.sampler_logprobs),
        chat_prompts=[batch.chat_prompts[r] for r in rows] if batch.chat_prompts else [],
        chat_completions=[batch.chat_completions[r] for r in rows] if batch.chat_completions else [],
    )
