"""A sampler's chunk with partial rollouts (``decoupled.partial_rollouts``): the chunk's prompt groups are started
beside the groups carried over from the sampler's earlier chunks, every running row gets one round of at most
``decoupled.partial_token_budget`` tokens, and the groups whose G rows have all ended make the chunk; the others stay
in the ``CarryOver`` for the next one. More rounds run only while no group has finished or more than a chunk's worth
of groups (its prompt count) would stay behind.

"Must be sent" is thus a token budget: a chunk costs about one round of ``budget`` decode steps, not its longest
completion, and the carry-over never holds more than one chunk's groups. A carried row continues from its prompt
and tokens so far, its keys/values kept from round to round and chunk to chunk (a ``PrefixCache``: it feeds its last
token, not a prefill; the keys/values stay those of the weights that drew each token, as in-flight updates leave
them); each token keeps the version and the log-prob of the weights that drew it, which the
trainer's staleness rule and its ratio use. A carried token survives the next chunk only if its version stays
within ``train.max_staleness`` of that chunk's step: a sampler runs a step ahead of the trainer and, one of K,
continues its carried groups every K-th step, so that takes about ``max_staleness`` K + 1; at 1 most carried groups
start over (``rollout/partial_groups_restarted``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from grpo.data import Example, build_prompt_messages
from grpo.data.prompt_sampler import PromptSampler, step_seed
from grpo.decoupled.carry_over import CarryOver, OpenGroup, group_id, group_place
from grpo.decoupled.work_plan import Chunk, chunk_of
from grpo.rollout.engine import completion_mask_from_ids
from grpo.rollout.generation import Generation
from grpo.rollout.hf import left_pad
from grpo.rollout.prefix_cache import PrefixCache
from grpo.step.experience import ExperienceSettings, RefLogprobs, finish_experience, render_prompts, score_generation
from grpo.step.records import RolloutBatch


@dataclass(frozen=True)
class PartialInputs:
    """What a partial chunk is made from besides the engine and the carry-over: the task's data and rewards."""

    tokenizer: object
    train_set: Sequence[Example]
    prompt_sampler: PromptSampler
    reward_fns: Sequence
    reward_weights: Sequence[float]
    settings: ExperienceSettings
    seed: int  # train.seed


def advance(engine, carry: CarryOver, params, seed: int, kept: PrefixCache | None = None) -> None:
    """One round: every running row of ``carry`` continues for up to ``carry.budget`` tokens (``engine``: an
    ``InFlightEngine``, whose generations carry ``token_versions`` and ``sampler_logprobs``). ``kept``: the rows'
    keys/values between rounds (a carried row then feeds only its last token instead of a prefill); only the
    running rows' stay in it."""
    for k, call in enumerate(carry.calls()):
        call_params = replace(params, n=call.per_prompt, max_tokens=call.max_tokens, min_new_tokens=call.min_new_tokens)
        ids = [group.prompt_ids + group.rows[j].tokens for group, j in call.rows[::call.per_prompt]]
        gen = engine.generate_ids(ids, call_params, seed=seed + k, prefix_cache=kept)
        Lp = gen.prompt_ids.shape[1]
        for i, (group, j) in enumerate(call.rows):
            mask = gen.completion_mask[i].bool()  # [Lc]: up to and including the EOS
            fed = len(group.prompt_ids) + len(group.rows[j].tokens)  # the row's prompt in this call, left-padded
            carry.extend(group, j, gen.completion_ids[i][mask].tolist(), gen.token_versions[i][mask].tolist(),
                         gen.sampler_logprobs[i][mask].tolist(), eos=not bool(gen.truncated[i]),
                         routing=None if gen.routing is None else gen.routing[i, Lp - fed:])
    if kept is not None:  # a row's entry holds its prompt and every token but the last (drawn, never fed)
        kept.retain({tuple(g.prompt_ids + r.tokens[:-1]) for g in carry.groups for r in g.rows
                     if r.tokens and not r.ended})


def groups_generation(groups: list[OpenGroup], tokenizer, eos_ids: Sequence[int]) -> Generation:
    """Finished groups as one ``Generation`` (G rows per group, in order), with their tokens' versions and
    sampler log-probs."""
    pad = tokenizer.pad_token_id
    rows = [row for g in groups for row in g.rows]
    width = max(len(r.tokens) for r in rows)

    def padded(values: list[list], value, dtype) -> torch.Tensor:
        return torch.tensor([v + [value] * (width - len(v)) for v in values], dtype=dtype)  # [N, width]

    completion_ids = padded([r.tokens for r in rows], pad, torch.long)
    mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)
    prompt_ids, prompt_mask = left_pad([g.prompt_ids for g in groups for _ in g.rows], pad)
    completion_ids = completion_ids.masked_fill(mask == 0, pad)
    return Generation(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=mask, truncated=truncated,
                      completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                      token_versions=padded([r.versions for r in rows], 0, torch.long) * mask,
                      sampler_logprobs=padded([r.logprobs for r in rows], 0.0, torch.float32) * mask,
                      routing=groups_routing(groups, prompt_ids.shape[1], width))


def groups_routing(groups: list[OpenGroup], prompt_width: int, width: int) -> torch.Tensor | None:
    """The rows' carried routing as ``Generation.routing`` [N, prompt_width + width, layers, k]: each prompt
    left-padded, each completion right-padded, with -1; None when the engine recorded none."""
    rows = [(len(g.prompt_ids), row) for g in groups for row in g.rows]
    if all(row.routing is None for _, row in rows):
        return None
    if any(row.routing is None for _, row in rows):
        raise ValueError("some finished rows carry recorded routing and others none")
    layers_k = rows[0][1].routing.shape[1:]
    out = torch.full((len(rows), prompt_width + width, *layers_k), -1, dtype=torch.int16)
    for i, (p, row) in enumerate(rows):
        out[i, prompt_width - p: prompt_width - p + row.routing.shape[0]] = row.routing
    return out


def open_groups(carry: CarryOver, inputs: PartialInputs, group_ids: Sequence[str], world_size: int) -> int:
    """Open groups by id (a chunk's own, or orphans adopted from a dead sampler): each id names its chunk's step and
    rank, whose prompts the prompt sampler gives again, and the prompt's place there. Returns how many opened."""
    prompts_of: dict[str, list[int]] = {}  # chunk id -> its prompts' rows in the training set
    indices = []
    for gid in group_ids:
        chunk_id, index = group_place(gid)
        if chunk_id not in prompts_of:
            if (named := chunk_of(chunk_id)) is None:
                raise ValueError(f"group id {gid[:80]!r} names no chunk (step-S/rank-R#INDEX)")
            prompts_of[chunk_id] = list(inputs.prompt_sampler.rank_indices(named.step, named.rank, world_size))
        if index >= len(prompts_of[chunk_id]):
            raise ValueError(f"group id {gid[:80]!r}: chunk {chunk_id} has {len(prompts_of[chunk_id])} prompts")
        indices.append(prompts_of[chunk_id][index])
    s = inputs.settings
    prompts = render_prompts(inputs.tokenizer, [inputs.train_set[i] for i in indices], s.system_prompt,
                             s.max_prompt_length)
    ids = [inputs.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return carry.open(list(group_ids), list(indices), ids, prompts)


def partial_experience(engine, policy, ref_logprobs_fn: RefLogprobs | None, carry: CarryOver, inputs: PartialInputs,
                       eos_ids: Sequence[int], *, chunk: Chunk, world_size: int, min_version: int,
                       settled: tuple[Sequence[str], Sequence[str]] = ((), ()),
                       adopt: Sequence[str] = (), kept: PrefixCache | None = None) -> tuple[RolloutBatch, dict]:
    """Chunk ``chunk``'s batch: the finished groups after its prompts joined the carry-over (groups older than
    ``min_version`` started over; so do the groups of chunks the trainer dropped since the last chunk:
    ``settled`` = (the chunk ids it trained and checkpointed, those it dropped); ``adopt``: a dead sampler's
    groups, started first) and at least one round ran (``kept``: the carried rows' keys/values, see ``advance``). The second value is the chunk's header keys: ``groups``
    (the ids of the batch's groups, in order), ``carried`` (those left open here) and the ``rollout/partial_*``
    counts."""
    started, reused = time.perf_counter(), kept.reused_tokens if kept is not None else 0
    reopened = carry.settle(*settled)
    restarted = carry.restart_stale(min_version)
    adopted = open_groups(carry, inputs, adopt, world_size)
    indices = inputs.prompt_sampler.rank_indices(chunk.step, chunk.rank, world_size)
    open_groups(carry, inputs, [group_id(chunk.id, i) for i in range(len(indices))], world_size)
    s = inputs.settings
    seed, finished, rounds = step_seed(inputs.seed, chunk.step, chunk.rank, 0), [], 0
    # Sent after a round once it holds a group and at most a chunk's worth of groups stays behind (the carry-over
    # stays bounded: a chunk starts that many, and sends as many on average).
    while not finished or len(carry.groups) > len(indices):
        advance(engine, carry, s.sampling, seed + 1000 * rounds, kept)
        finished, rounds = finished + carry.take_finished(), rounds + 1
    carry.sent(chunk.id, finished)
    examples = [inputs.train_set[g.example_index] for g in finished]
    G = s.sampling.n
    chat_prompts = [e.question if e.plain_text else build_prompt_messages(e, s.system_prompt)
                    for e in examples for _ in range(G)]
    scored = score_generation(examples, [g.prompt for g in finished], groups_generation(finished, inputs.tokenizer,
                              eos_ids), chat_prompts, {}, inputs.reward_fns, inputs.reward_weights, s,
                              steps_done=chunk.step - 1, generate_s=time.perf_counter() - started)
    carried_tokens = sum(len(r.tokens) for g in carry.groups for r in g.rows)
    return finish_experience(scored, policy, ref_logprobs_fn, s), {
        "groups": [g.group_id for g in finished], "carried": [g.group_id for g in carry.groups],
        "rollout/partial_groups_adopted": float(adopted), "rollout/partial_groups_sent": float(len(finished)),
        "rollout/partial_groups_carried": float(len(carry.groups)),
        "rollout/partial_tokens_carried": float(carried_tokens),
        "rollout/partial_groups_restarted": float(len(restarted) + len(reopened)),
        "rollout/partial_rounds": float(rounds),
        "rollout/partial_kv_reused_tokens": float(kept.reused_tokens - reused if kept is not None else 0)}
