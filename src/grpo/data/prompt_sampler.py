"""Which prompts each step and rank trains on, and the seed it samples them with: pure functions of
(seed, step, rank), and of the round for dynamic sampling's extra prompts.

The stream is epoch after epoch of the dataset, each epoch a seeded permutation. Step ``s`` (1-based)
takes stream positions ``[(s-1)*P, s*P)`` and rank ``r`` of ``W`` its contiguous ``P/W`` of them, so a
prompt's whole group stays on one rank, ranks never share prompts, and resuming at step ``s`` needs
no saved sampler state.

Dynamic sampling (``rollout.dynamic_sampling``) draws more prompts in rounds ``1, 2, ...`` of a step
(``extra_indices``). They come from a permutation of their own per step, not from the stream: taking
them from the stream would shift every later step's prompts by an amount that depends on the rewards,
so the schedule (and ``epoch``) would no longer be a function of the step. The step's permutation
leaves out the step's own prompts (all ranks'), and round ``k`` of rank ``r`` takes its
``(k-1)*W + r``-th block of ``P/W``: no two ranks and no two rounds of a step share a prompt (until the
dataset runs out and the blocks wrap). Extra prompts may come up again in later steps' streams: they
are a draw with replacement across steps.
"""

from __future__ import annotations

import hashlib

import torch


def step_seed(seed: int, step: int, rank: int, round_index: int = 0) -> int:
    """A distinct, reproducible sampling seed per (run seed, step, rank), and per dynamic-sampling round:
    a resumed run draws the same completions as an uninterrupted one. Round 0 is the step's ordinary seed
    (a run with dynamic sampling samples its first round exactly as one without)."""
    base = (seed * 1_000_003 + step * 1_009 + rank) % (2**63)
    return base if round_index == 0 else _mix("round", base, round_index)


def _mix(*parts) -> int:
    """A 63-bit seed from the parts; the same in every process (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


class PromptSampler:
    """Dataset indices per step and rank (see the module docstring); state is only the seed."""

    def __init__(self, num_examples: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ValueError("the training set is empty")
        self.num_examples = num_examples
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self._epoch_cache: dict[int, list[int]] = {}
        self._extra_cache: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epoch_cache:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                order = torch.randperm(self.num_examples, generator=gen).tolist()
            else:
                order = list(range(self.num_examples))
            self._epoch_cache = {epoch: order}  # one epoch at a time is all a step needs (plus the next)
        return self._epoch_cache[epoch]

    def step_indices(self, step: int) -> list[int]:
        """Dataset indices of all ``P`` prompts of ``step`` (1-based), in rank order."""
        start = (step - 1) * self.prompts_per_step
        out = []
        for position in range(start, start + self.prompts_per_step):
            epoch, offset = divmod(position, self.num_examples)
            out.append(self._epoch_order(epoch)[offset])
        return out

    def rank_indices(self, step: int, rank: int, world_size: int) -> list[int]:
        """This rank's share of the step's prompts (``P / world_size`` of them)."""
        if self.prompts_per_step % world_size != 0:
            raise ValueError(f"train.prompts_per_step {self.prompts_per_step} is not divisible by the "
                             f"{world_size} ranks: each rank needs whole prompts (groups are never split)")
        share = self.prompts_per_step // world_size
        return self.step_indices(step)[rank * share:(rank + 1) * share]

    def extra_indices(self, step: int, rank: int, world_size: int, round_index: int) -> list[int]:
        """Dynamic sampling: this rank's ``P / world_size`` further prompts for round ``round_index`` >= 1 of
        ``step`` (see the module docstring for why they are not the stream's next ones)."""
        if round_index < 1:
            raise ValueError(f"extra prompts are for rounds 1, 2, ...; round 0 is rank_indices (got {round_index})")
        share = len(self.rank_indices(step, rank, world_size))
        if step not in self._extra_cache:
            gen = torch.Generator().manual_seed(_mix("extra", self.seed, step))
            order = torch.randperm(self.num_examples, generator=gen).tolist()
            taken = set(self.step_indices(step))
            # Without the step's own prompts, unless they are the whole dataset (then any prompt repeats one).
            self._extra_cache = {step: [i for i in order if i not in taken] or order}
        pool = self._extra_cache[step]
        start = ((round_index - 1) * world_size + rank) * share
        return [pool[position % len(pool)] for position in range(start, start + share)]

    def epoch_of(self, step: int) -> float:
        """Epochs consumed after ``step`` (for logging)."""
        return step * self.prompts_per_step / self.num_examples
