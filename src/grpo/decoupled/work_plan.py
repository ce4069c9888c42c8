"""Which sampler makes which chunk: the trainer's plan of the samplers' work (decoupled mode).

A step's batch is one chunk per trainer rank (the prompts and seeds that rank would sample colocated), and a
chunk is the unit of work. Samplers ask for work; the trainer hands each one open chunk at a time, so K
samplers make a step's W chunks about min(K, W) times faster, even at ``max_staleness`` 0. Step ``s`` opens
once weights of version ``s - 1 - max_staleness`` are published: a chunk made from them (or newer ones) is
never too stale to train at step ``s``. The first copy of a chunk to arrive counts; a chunk given to a
sampler that restarted or went silent goes to the next sampler that asks.

With partial rollouts a sampler also holds groups it started and has not sent (its chunks' headers list them:
``carried``). When it restarts or goes silent those groups are orphans: the next sampler handed a chunk adopts
them (the chunk's ``adopt``) and makes them from the start, so a sampler's death loses no prompt. A silent
sampler that comes back may still send some: the trainer trains a group id once.

The plan is pure bookkeeping (no sockets, no clock of its own); ``RolloutReceiver`` calls it under its lock.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

_CHUNK_ID = re.compile(r"step-(\d+)/rank-(\d+)")


@dataclass(frozen=True, order=True)
class Chunk:
    """Trainer rank ``rank``'s share of step ``step``'s batch."""

    step: int
    rank: int

    @property
    def id(self) -> str:
        """The chunk's batch id on the wire (``step-3/rank-1``)."""
        return f"step-{self.step}/rank-{self.rank}"


def chunk_of(batch_id: str) -> Chunk | None:
    """The chunk a batch id names, or None when it names none."""
    match = _CHUNK_ID.fullmatch(batch_id)
    return Chunk(int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True)
class Assignment:
    """What a sampler is told to make: a chunk, from weights of version ``min_version`` or newer."""

    chunk: Chunk
    min_version: int
    adopt: tuple[str, ...] = ()  # orphaned partial-rollout group ids to start beside the chunk's own

    def header(self) -> dict:
        return {"batch_id": self.chunk.id, "step": self.chunk.step, "rank": self.chunk.rank,
                "min_version": self.min_version, "adopt": list(self.adopt)}


class WorkPlan:
    """The trainer's open chunks, who makes each, and which arrived.

    ``ranks``: trainer ranks (chunks per step). ``trained_steps``: steps trained already (a resumed run's
    start step). ``version``: the newest published weights' version.
    """

    def __init__(self, ranks: int, max_staleness: int, trained_steps: int = 0, version: int = 0):
        if ranks < 1 or max_staleness < 0 or trained_steps < 0 or version < 0:
            raise ValueError(f"bad work plan: ranks {ranks}, max_staleness {max_staleness}, "
                             f"trained_steps {trained_steps}, version {version}")
        self.ranks, self.max_staleness = ranks, max_staleness
        self.trained_steps, self.version = trained_steps, version
        self.assigned: dict[Chunk, str] = {}  # given to a sampler, not arrived yet
        self.arrived: set[Chunk] = set()      # arrived, not trained yet
        self.waiting: list[str] = []          # samplers that asked while nothing was open, first asker first
        self.carried: dict[str, set[str]] = {}  # sampler -> partial-rollout groups it holds unsent
        self.orphans: set[str] = set()        # groups whose sampler restarted or went silent, not adopted yet
        self.adopting: dict[Chunk, tuple[str, ...]] = {}  # orphans handed out with an assigned chunk

    def min_version(self, step: int) -> int:
        """The oldest weights step ``step``'s chunks may be made from."""
        return max(0, step - 1 - self.max_staleness)

    def last_open_step(self) -> int:
        return self.version + 1 + self.max_staleness

    def want(self, sampler: str, alive: Collection[str]) -> Assignment | None:
        """A chunk for ``sampler`` to make (the one it holds, if any: asking again is safe), or None when no
        chunk is open (it is then remembered as waiting). Chunks held by samplers not in ``alive`` are free."""
        held = next((c for c, s in self.assigned.items() if s == sampler), None)
        chunk = held or self._free_chunk(alive)
        if chunk is None:
            if sampler not in self.waiting:
                self.waiting.append(sampler)
            return None
        self.assigned[chunk] = sampler
        if sampler in self.waiting:
            self.waiting.remove(sampler)
        if held is None:
            for silent in [s for s in self.carried if s not in alive]:
                self.orphans |= self.carried.pop(silent)
            self.adopting[chunk] = tuple(sorted(self.orphans))
            self.carried.setdefault(sampler, set()).update(self.orphans)
            self.orphans = set()
        return Assignment(chunk, self.min_version(chunk.step), self.adopting.get(chunk, ()))

    def carries(self, sampler: str, groups: Collection[str]) -> None:
        """``sampler``'s newest chunk says it holds ``groups`` unsent (partial rollouts); orphans it adopted with a
        chunk not arrived yet count too (a chunk made before that one may arrive after it was handed out)."""
        adopted = {g for c, s in self.assigned.items() if s == sampler for g in self.adopting.get(c, ())}
        self.carried[sampler] = set(groups) | adopted

    def owes(self, sampler: str, groups: Collection[str]) -> None:
        """``sampler`` holds ``groups`` again: they were in a chunk of its that the trainer dropped (it starts them
        over with its next chunk; should it die first, they are orphans)."""
        self.carried.setdefault(sampler, set()).update(groups)

    def arrived_from(self, chunk: Chunk, sampler: str) -> bool:
        """Record ``chunk``'s arrival; False when it is not wanted (trained, or a copy arrived first)."""
        if chunk.step <= self.trained_steps or chunk in self.arrived or not 0 <= chunk.rank < self.ranks:
            return False
        self.assigned.pop(chunk, None)
        self.adopting.pop(chunk, None)
        self.arrived.add(chunk)
        return True

    def reopen(self, chunk: Chunk) -> None:
        """A chunk that arrived cannot be trained (too stale): make it again."""
        self.arrived.discard(chunk)
        self.assigned.pop(chunk, None)

    def forget_sampler(self, sampler: str) -> None:
        """``sampler`` restarted or left: what it was making is free again, and the groups it held are orphans."""
        for chunk in [c for c, s in self.assigned.items() if s == sampler]:
            del self.assigned[chunk]
            self.adopting.pop(chunk, None)
        self.orphans |= self.carried.pop(sampler, set())
        if sampler in self.waiting:
            self.waiting.remove(sampler)

    def trained(self, step: int) -> None:
        """Step ``step`` is trained: its chunks (and older ones) leave the plan."""
        self.trained_steps = max(self.trained_steps, step)
        self.arrived = {c for c in self.arrived if c.step > step}
        self.assigned = {c: s for c, s in self.assigned.items() if c.step > step}
        self.adopting = {c: a for c, a in self.adopting.items() if c in self.assigned}

    def published(self, version: int, alive: Collection[str]) -> list[tuple[str, Assignment]]:
        """Weights ``version`` are out: more steps open. Returns work for the samplers that were waiting."""
        self.version = max(self.version, version)
        return self.serve_waiting(alive)

    def serve_waiting(self, alive: Collection[str]) -> list[tuple[str, Assignment]]:
        """Work for waiting samplers, while there is some."""
        out = []
        for sampler in list(self.waiting):
            if sampler in alive and (assignment := self.want(sampler, alive)) is not None:
                out.append((sampler, assignment))
        return out

    def _free_chunk(self, alive: Collection[str]) -> Chunk | None:
        for step in range(self.trained_steps + 1, self.last_open_step() + 1):
            for rank in range(self.ranks):
                chunk = Chunk(step, rank)
                if chunk in self.arrived:
                    continue
                holder = self.assigned.get(chunk)
                if holder is None or holder not in alive:
                    return chunk
        return None
