"""PTX: a supervised next-token loss beside the RL loss (PaddleNLP's ``ptx_coeff * ptx_loss``, InstructGPT's
PPO-ptx), so the policy keeps its SFT behaviour and format while RL moves it.

Data flow: ``ptx.data`` -> ``SftPair`` (``grpo.data.sft``) -> ``tokenize_pairs`` (the prompt rendered as the
RL prompts are: the run's system prompt, the chat template, the generation prompt; the response's tokens and
the EOS after it, as a sampled completion ends) -> ``PtxData.batch(step, rank)`` (an ``SftBatch``) ->
``ptx_nll`` (the mean NLL of its response tokens) -> ``train_on_batch`` adds ``coef x`` it to every update.

Which pairs a step trains on is a pure function of (seed, step, rank), like the RL prompts
(``PromptSampler``): a resumed run trains on the same PTX batches as an uninterrupted one, and the ranks of
a step get different pairs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from grpo.algorithm import sft_loss
from grpo.data.prompt_sampler import PromptSampler
from grpo.data.sft_tokens import TokenizedPair
from grpo.step.logprob_pass import DEVICE_DEFAULT_PASS, LogprobPass
from grpo.step.logprobs import _to_device, completion_logprobs
from grpo.step.records import SftBatch

# Added to train.seed for the PTX order: with the same file as data.train and the same seed, the PTX pairs
# of a step would otherwise be the step's RL prompts.
PTX_SEED_OFFSET = 7919


def collate(rows: Sequence[TokenizedPair], pad_id: int) -> SftBatch:
    """Rows -> an ``SftBatch`` on the CPU: prompts left-padded, responses right-padded (as a ``Generation``)."""
    def padded(sequences: list[list[int]], side: str) -> tuple[Tensor, Tensor]:
        tensors = [torch.tensor(s, dtype=torch.long) for s in sequences]
        ids = pad_sequence(tensors, batch_first=True, padding_value=pad_id, padding_side=side)
        mask = pad_sequence([torch.ones_like(t) for t in tensors], batch_first=True, padding_side=side)
        return ids, mask

    prompt_ids, prompt_mask = padded([r.prompt_ids for r in rows], "left")  # [B, Lp] each
    response_ids, response_mask = padded([r.response_ids for r in rows], "right")  # [B, Lr] each
    return SftBatch(prompt_ids, prompt_mask, response_ids, response_mask, [r.source for r in rows])


class PtxData:
    """The tokenized PTX pairs and which of them each (step, rank) trains on."""

    def __init__(self, rows: list[TokenizedPair], *, micro_batch_size: int, world_size: int, seed: int,
                 pad_id: int):
        self.rows, self.world_size, self.pad_id = rows, world_size, pad_id
        # The stream of seeded epochs cut in micro_batch_size pieces per rank, as PromptSampler cuts the RL
        # prompts: each step's pairs depend on (seed, step, rank) alone.
        self.sampler = PromptSampler(len(rows), micro_batch_size * world_size, seed + PTX_SEED_OFFSET)

    def indices(self, step: int, rank: int) -> list[int]:
        """Rows that rank ``rank`` trains on in step ``step`` (1-based)."""
        return self.sampler.rank_indices(step, rank, self.world_size)

    def batch(self, step: int, rank: int) -> SftBatch:
        """The ``SftBatch`` of rank ``rank`` in step ``step``."""
        return collate([self.rows[i] for i in self.indices(step, rank)], self.pad_id)


def ptx_nll(model: torch.nn.Module, batch: SftBatch, logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS) -> Tensor:
    """Scalar: the mean NLL of ``batch``'s response tokens under ``model`` (temperature 1: the data's
    likelihood, not the sampling distribution's), with gradients when grad is enabled.

    ``completion_logprobs`` scores the responses exactly as the RL update scores completions (the same
    positions, padding and checkpointing handling), so PTX works wherever the policy loss does."""
    logprobs = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                   batch.response_mask, temperature=1.0, share_prompts=logprob_pass.share_prompts,
                                   column_bucket=logprob_pass.column_bucket,
                                   fused_head=logprob_pass.fused_head, pack=logprob_pass.pack)  # [B, Lr]
    # Pinned and without waiting, as completion_logprobs copies its inputs: the update queues work, never waits.
    return sft_loss(logprobs, _to_device(batch.response_mask, logprobs.device))
