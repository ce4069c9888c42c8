"""Partial rollouts' bookkeeping (``decoupled.partial_rollouts``): the prompt groups a sampler has started and
not yet sent, with each row's tokens so far, the version of the weights that drew each token and its log-prob.

A chunk's generation runs for a token budget; a group all of whose G rows have ended (EOS or
``rollout.max_completion_length``) goes into the chunk, and a group with a row still running stays here and continues in
the sampler's next chunk (GRPO's advantages need the whole group). Each group keeps the id of the chunk whose
prompts it belongs to and its place there (``step-3/rank-0#2``): the trainer trains a group id at most once
(it keeps the trained ids in its checkpoints), so a group made twice (its chunk made again) is never trained
twice; a sent group is kept until its chunk is trained and checkpointed, and starts over if the trainer drops the
chunk instead. A group whose oldest token is too old for the chunk being made is started over: the staleness rule
(``train.max_staleness``) holds per token. An MoE policy's recorded routing (routing replay) is carried per row the same
way. Pure bookkeeping: no engine, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


# The trainer's reason for dropping a chunk whose every group it trained already (from another copy): the chunk is
# made again, but its groups are not (a sampler does not start them over).
ALL_GROUPS_TRAINED = "every group in it is trained already"


def group_id(chunk_id: str, index: int) -> str:
    """The id of group ``index`` of chunk ``chunk_id``'s prompts (``step-3/rank-0#2``)."""
    return f"{chunk_id}#{index}"


def group_place(gid: str) -> tuple[str, int]:
    """The chunk id and the prompt index a group id names (``group_id``'s inverse); ValueError for another string."""
    chunk_id, _, index = gid.rpartition("#")
    if not chunk_id or not index.isdigit():
        raise ValueError(f"{gid[:80]!r} is not a partial-rollout group id (CHUNK#INDEX, e.g. step-3/rank-0#2)")
    return chunk_id, int(index)


@dataclass
class OpenRow:
    """One completion so far: its tokens, each token's weights version and sampler log-prob (same length), and,
    when the engine records an MoE policy's routing, the experts each position of prompt + tokens was routed to."""

    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ended: bool = False
    eos: bool = False  # ended with an EOS (else cut at rollout.max_completion_length: truncated)
    routing: Tensor | None = None  # [prompt + tokens, layers, k] int16, -1 where no pass fed the position yet


@dataclass
class OpenGroup:
    """The G completions of one prompt, some still running."""

    group_id: str
    example_index: int  # the prompt's row in the training set
    prompt_ids: list[int]
    prompt: str  # the rendered prompt the ids encode
    rows: list[OpenRow]

    @property
    def finished(self) -> bool:
        return all(row.ended for row in self.rows)

    def oldest_version(self) -> int | None:
        """The oldest version among the group's tokens; None before its first token."""
        return min((min(row.versions) for row in self.rows if row.versions), default=None)


@dataclass(frozen=True)
class RowCall:
    """What one engine call continues: ``rows`` for up to ``max_tokens`` more tokens each, EOS forbidden for the first
    ``min_new_tokens`` of them."""

    max_tokens: int
    min_new_tokens: int
    rows: tuple[tuple[OpenGroup, int], ...]  # (group, row index)
    per_prompt: int = 1  # G: whole fresh groups, every G rows one prompt (one prefill, its cache shared)


class CarryOver:
    """A sampler's open groups, oldest first. ``group_size``: G; ``max_tokens``: rollout.max_completion_length (a row's
    whole completion); ``budget``: decoupled.partial_token_budget (tokens a row gets per round);
    ``min_new_tokens``: rollout.min_new_tokens (of the whole completion)."""

    def __init__(self, group_size: int, max_tokens: int, budget: int, min_new_tokens: int = 0):
        if group_size < 1 or max_tokens < 1 or budget < 1 or min_new_tokens < 0:
            raise ValueError(f"bad carry-over: group_size {group_size}, max_tokens {max_tokens}, budget {budget}, "
                             f"min_new_tokens {min_new_tokens}")
        self.group_size, self.max_tokens, self.budget = group_size, max_tokens, budget
        self.min_new_tokens = min_new_tokens
        self.groups: list[OpenGroup] = []
        self.unsettled: dict[str, list[OpenGroup]] = {}  # chunk id -> its groups, until the trainer settles it

    def start(self, chunk_id: str, example_indices: list[int], prompt_ids: list[list[int]],
              prompts: list[str]) -> int:
        """Open chunk ``chunk_id``'s groups (its prompts, in order); see ``open``."""
        return self.open([group_id(chunk_id, i) for i in range(len(example_indices))], example_indices, prompt_ids,
                         prompts)

    def open(self, group_ids: list[str], example_indices: list[int], prompt_ids: list[list[int]],
             prompts: list[str]) -> int:
        """Open these groups, each with G empty rows; a group still open here (its chunk made again after the
        trainer dropped it, or an orphan this sampler holds already) is not opened twice. Returns how many opened."""
        open_ids, opened = {g.group_id for g in self.groups}, 0
        for gid, example, ids, text in zip(group_ids, example_indices, prompt_ids, prompts, strict=True):
            if gid not in open_ids:
                self.groups.append(OpenGroup(gid, example, list(ids), text, [OpenRow() for _ in range(self.group_size)]))
                open_ids.add(gid)
                opened += 1
        return opened

    def restart_stale(self, min_version: int) -> list[str]:
        """Start over every group with a token drawn by weights older than ``min_version`` (the oldest the
        chunk being made may hold); returns their ids."""
        restarted = []
        for group in self.groups:
            oldest = group.oldest_version()
            if oldest is not None and oldest < min_version:
                group.rows = [OpenRow() for _ in range(self.group_size)]
                restarted.append(group.group_id)
        return restarted

    def calls(self) -> list[RowCall]:
        """The running rows in as few engine calls as their EOS rule allows: rows of any length share a call (a
        row's tokens so far are part of its prompt there), each for the whole budget; a row with less room left
        keeps only what fits (``extend``; what it keeps is drawn from the distribution a call of its own would use).
        Only
        ``rollout.min_new_tokens`` splits them, by the EOS-free tokens each has left within the budget (no more than
        the call's tokens: vLLM refuses a min_tokens above max_tokens, and it means the same)."""
        fresh = [g for g in self.groups if not any(row.tokens or row.ended for row in g.rows)]
        by_min_new: dict[int, list[tuple[OpenGroup, int]]] = {}
        for group in self.groups:
            for j, row in enumerate(group.rows):
                if not row.ended and group not in fresh:
                    by_min_new.setdefault(self._eos_free(len(row.tokens)), []).append((group, j))
        calls = [RowCall(self.budget, min_new, tuple(rows)) for min_new, rows in sorted(by_min_new.items())]
        if fresh:
            rows = tuple((g, j) for g in fresh for j in range(self.group_size))
            calls.insert(0, RowCall(self.budget, self._eos_free(0), rows, per_prompt=self.group_size))
        return calls

    def _eos_free(self, drawn: int) -> int:
        """How many of a call's tokens must not be EOS for a row with ``drawn`` tokens so far."""
        return min(max(0, self.min_new_tokens - drawn), self.budget)

    def extend(self, group: OpenGroup, j: int, tokens: list[int], versions: list[int], logprobs: list[float],
               eos: bool, routing: Tensor | None = None) -> None:
        """Row ``j`` of ``group`` drew ``tokens`` (with their versions and log-probs); it ends at an EOS (the
        last token) or at ``max_tokens`` tokens in all (tokens past that are cut off). ``routing``: the call's
        recording of the row, [prompt + tokens so far + ``tokens``, layers, k]; a position routed in an earlier
        round keeps that round's experts (those of the weights that drew the token after it), the rest take
        this call's."""
        max_tokens = self.max_tokens
        if not len(tokens) == len(versions) == len(logprobs):
            raise ValueError(f"{len(tokens)} tokens, {len(versions)} versions, {len(logprobs)} log-probs")
        row = group.rows[j]
        if row.ended:
            raise ValueError(f"row {j} of group {group.group_id} has ended already")
        room = max_tokens - len(row.tokens)
        if len(tokens) > room:  # drawn past the completion's end: what follows was never part of it
            tokens, versions, logprobs, eos = tokens[:room], versions[:room], logprobs[:room], False
        if routing is not None:
            row.routing = joined_routing(row.routing, routing[:len(group.prompt_ids) + len(row.tokens) + len(tokens)])
        elif row.routing is not None:
            raise ValueError(f"row {j} of group {group.group_id} has recorded routing but this call recorded none")
        row.tokens += tokens
        row.versions += versions
        row.logprobs += logprobs
        row.eos = eos
        row.ended = eos or len(row.tokens) == max_tokens

    def sent(self, chunk_id: str, groups: list[OpenGroup]) -> None:
        """``groups`` left in chunk ``chunk_id``: kept until the trainer trains it (checkpointed) or drops it."""
        self.unsettled[chunk_id] = list(groups)

    def settle(self, trained: list[str], dropped: list[str]) -> list[str]:
        """The trainer trained chunks ``trained`` (in a checkpoint) and dropped chunks ``dropped`` untrained: the
        dropped chunks' groups start over here (those already open here, the chunk being made again, stay as
        they are). Returns the ids of the groups opened again."""
        for chunk_id in trained:
            self.unsettled.pop(chunk_id, None)
        open_ids, reopened = {g.group_id for g in self.groups}, []
        for chunk_id in dropped:
            for group in self.unsettled.pop(chunk_id, []):
                if group.group_id not in open_ids:
                    rows = [OpenRow() for _ in range(self.group_size)]
                    self.groups.append(OpenGroup(group.group_id, group.example_index, group.prompt_ids, group.prompt,
                                                 rows))
                    open_ids.add(group.group_id)
                    reopened.append(group.group_id)
        return reopened

    def take_finished(self) -> list[OpenGroup]:
        """The groups whose rows have all ended, oldest first, removed from the carry-over."""
        done = [g for g in self.groups if g.finished]
        self.groups = [g for g in self.groups if not g.finished]
        return done


def joined_routing(earlier: Tensor | None, now: Tensor) -> Tensor:
    """A row's routing after one more call: ``now`` [T, layers, k] (the call's, over the row's positions so far),
    where ``earlier`` [t <= T, ...] recorded nothing (-1) or does not reach, else ``earlier``'s."""
    if earlier is None:
        return now.clone()
    if earlier.shape[0] > now.shape[0] or earlier.shape[1:] != now.shape[1:]:
        raise ValueError(f"a row's routing {tuple(earlier.shape)} does not line up with the call's {tuple(now.shape)}")
    joined = now.clone()
    head = joined[:earlier.shape[0]]
    kept = (earlier >= 0).all(-1, keepdim=True)  # [t, layers, 1]: positions a pass fed (every layer at once)
    joined[:earlier.shape[0]] = torch.where(kept, earlier, head)
    return joined
