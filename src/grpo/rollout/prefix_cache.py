"""Keys/values kept between the turns of one multi-turn rollout, for the ``hf`` and ``hf-static``
engines: a row's next turn prefills only the tokens its cached prefix lacks.

A multi-turn row's next prompt is its previous prompt + the turn it sampled + the tool result. When a row
stops sampling, the engine stores the keys/values of every token it fed the model (the prompt and the sampled
tokens but the last one, which was drawn and never fed) as a ``CachedPrefix``, compacted: left padding and
other rows' slots dropped. The next call looks each prompt up (the longest stored prefix of its ids) and feeds
the model only the rest: the last sampled token, then the tool result. Causal attention makes that exact: a
position's keys/values depend only on the tokens up to it, and they were computed at the same positions
(rotary embeddings included), so only the float order of the attention sums differs from a full prefill.

Lifetime: a ``PrefixCache`` lives inside one ``engine.cached_turns()`` context (``CachedTurns``), which the
multi-turn driver opens around one rollout; leaving it (normally or by an exception) drops every entry and
closes the cache, and a closed cache refuses to be used. So keys/values computed with one step's weights
can never be read after the optimizer has changed them. Inside the context the weights must not change
(nothing in a rollout changes them). A matched entry is dropped once it has been continued (the row's new
entry holds it), so the cache holds about one entry per row.

One exception, on purpose: partial rollouts (``grpo.decoupled.partial_rollouts``) keep one cache across a
sampler's chunks for the rows they carry over, whose keys/values stay those of the weights that drew the tokens,
as weights updated in flight leave them (``grpo.rollout.in_flight``); ``retain`` drops the rows that ended.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from torch import Tensor

from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation


@dataclass
class CachedPrefix:
    """One row's keys/values: ``ids`` [T] the tokens they belong to (position i holds token ids[i]);
    ``keys``/``values`` one [heads, T, head_dim] tensor per layer."""

    ids: list[int]
    keys: list[Tensor]
    values: list[Tensor]


class PrefixCache:
    """The stored rows of one rollout. ``fed_tokens``/``reused_tokens``: prompt tokens the prefills fed the
    model (left padding included) and those a cached prefix spared it."""

    def __init__(self):
        self.entries: list[CachedPrefix] = []
        self.closed = False
        self.fed_tokens = 0
        self.reused_tokens = 0

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this prefix cache was cleared when its rollout ended (its keys/values belong to "
                               "weights that have changed since); open a new engine.cached_turns() context")

    def take(self, prompts: Sequence[list[int]]) -> list[CachedPrefix | None]:
        """Per prompt, the longest entry whose ids are a proper prefix of it (at least one token must be fed to
        get the next logits), or None. The matched entries leave the cache."""
        self.check_open()
        found: list[CachedPrefix | None] = []
        used: set[int] = set()
        for prompt in prompts:
            best, best_key = None, None
            for entry in self.entries:
                n = len(entry.ids)
                # of equal entries (greedy samples of one prompt), one not yet matched: each then leaves
                key = (n, id(entry) not in used)
                if n < len(prompt) and (best_key is None or key > best_key) and prompt[:n] == entry.ids:
                    best, best_key = entry, key
            found.append(best)
            if best is not None:
                used.add(id(best))
        self.entries = [entry for entry in self.entries if id(entry) not in used]
        return found

    def store(self, layers: Sequence, rows: Tensor, slots: Tensor, ids: Sequence[list[int]]) -> None:
        """Keep rows ``rows`` ([r] long) of a batch's cache ``layers`` (each with ``keys``/``values``
        [B, heads, W, d]): row i's real slots are where ``slots[i]`` ([r, W] bool) is True, holding ``ids[i]``."""
        self.check_open()
        wheres = [slots[i].nonzero().squeeze(-1) for i in range(len(ids))]  # [T_i] each
        for where, row_ids in zip(wheres, ids):
            if len(where) != len(row_ids):
                raise RuntimeError(f"prefix cache: {len(where)} filled slots for {len(row_ids)} tokens")
        keys: list[list[Tensor]] = [[] for _ in ids]
        values: list[list[Tensor]] = [[] for _ in ids]
        for layer in layers:  # row by row: only the kept slots are copied, never a whole batch's cache
            for i, (row, where) in enumerate(zip(rows.tolist(), wheres)):
                keys[i].append(layer.keys[row][:, where])  # [h, T_i, d]
                values[i].append(layer.values[row][:, where])
        self.entries += [CachedPrefix(list(row_ids), k, v) for row_ids, k, v in zip(ids, keys, values)]

    def retain(self, ids: set[tuple[int, ...]]) -> None:
        """Keep only the entries whose token ids are in ``ids`` (the rows that may still be continued)."""
        self.check_open()
        self.entries = [entry for entry in self.entries if tuple(entry.ids) in ids]

    def clear(self) -> None:
        self.entries = []
        self.closed = True


class CachedTurns:
    """The engine a ``cached_turns()`` context yields: ``generate_ids`` through one ``PrefixCache``."""

    def __init__(self, engine, cache: PrefixCache):
        self.engine, self.cache = engine, cache

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     seed: int | None = None) -> Generation:
        return self.engine.generate_ids(prompt_ids, params, seed, prefix_cache=self.cache)


@contextmanager
def cached_turns(engine) -> Iterator[CachedTurns]:
    """``engine.cached_turns()``: a fresh cache for the block, cleared and closed when it exits."""
    cache = PrefixCache()
    try:
        yield CachedTurns(engine, cache)
    finally:
        cache.clear()
