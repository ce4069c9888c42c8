"""Which prompts each step and rank trains on: a pure function of (seed, step, rank).

The stream is epoch after epoch of the dataset, each epoch a seeded permutation. Step ``s`` (1-based)
takes stream positions ``[(s-1)*P, s*P)`` and rank ``r`` of ``W`` its contiguous ``P/W`` of them, so a
prompt's whole group stays on one rank, ranks never share prompts, and resuming at step ``s`` needs
no saved sampler state.
"""

from __future__ import annotations

import torch


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

    def epoch_of(self, step: int) -> float:
        """Epochs consumed after ``step`` (for logging)."""
        return step * self.prompts_per_step / self.num_examples
