"""Rollouts with Hugging Face ``generate`` (KV-cached, batched): the CPU and default engine."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
from torch import Tensor
from transformers import GenerationConfig

from grpo.compat import generate_repetition_penalty
from grpo.models.wrappers import eos_token_ids, unwrap_model
from grpo.rollout.engine import SamplingParams, completion_mask_from_ids
from grpo.rollout.generation import Generation


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Dropout off while sampling; the previous train/eval mode comes back afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[B] lists of ids -> (ids [B, Lmax], mask [B, Lmax]), padded on the left for generation."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids, mask


class HFEngine:
    """Batched sampling with ``model.generate``; every sampling parameter is set explicitly so that the
    checkpoint's own generation_config (e.g. Qwen's top_k=20, repetition_penalty=1.05) never changes
    the distribution the log-probs are computed for. ``repetition_penalty``, ``min_new_tokens`` and
    ``min_p`` are generate's own processors (``generate`` excludes the prompts' left padding from the
    penalty, as the other engines and the log-probs do; before transformers 5.23 through ``grpo.compat``)."""

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # completions per generate() call; None = all at once
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no pad token; set one (e.g. the EOS)")

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        """``params.n`` completions per rendered prompt, rows grouped per prompt (see ``Generation``).
        ``seed`` seeds torch's RNG first, so the same seed gives the same completions."""
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     seed: int | None = None) -> Generation:
        """``generate`` from token ids. Every call prefills its prompts whole: ``generate`` keeps no cache
        between calls (a multi-turn row's next turn re-reads its conversation; the ``hf`` engine does not)."""
        model = unwrap_model(self.model)
        pad_id = self.tokenizer.pad_token_id
        eos_ids = eos_token_ids(model, self.tokenizer)
        encoded = [list(ids) for ids in prompt_ids]
        prompts_per_call = max(1, (self.batch_size or len(encoded) * params.n) // params.n)
        config = self._generation_config(params, pad_id, eos_ids)
        if seed is not None:
            torch.manual_seed(seed)
        device = next(model.parameters()).device
        chunks = []
        with eval_mode(model), torch.no_grad():
            for start in range(0, len(encoded), prompts_per_call):
                ids, mask = left_pad(encoded[start:start + prompts_per_call], pad_id)
                call_config, processors = generate_repetition_penalty(config, mask)
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     generation_config=call_config, logits_processor=processors)
                chunks.append(out[:, ids.shape[1]:].cpu())  # [chunk * n, <= max_tokens]
        width = max(c.shape[1] for c in chunks)
        completion_ids = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])
        completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)  # nothing after the first EOS
        prompt_ids, prompt_mask = left_pad(encoded, pad_id)
        return Generation(
            prompt_ids=prompt_ids.repeat_interleave(params.n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(params.n, dim=0),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            truncated=truncated,
            completions=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        )

    @staticmethod
    def _generation_config(params: SamplingParams, pad_id: int, eos_ids: list[int]):
        greedy = params.greedy or params.temperature == 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                      "top_k": params.top_k or 0,  # 0, not None: None falls back to 50
                                      "min_p": params.min_p or None}  # None: no MinPLogitsWarper at all
        return GenerationConfig(
            do_sample=not greedy,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            repetition_penalty=params.repetition_penalty,  # generate skips the processor at 1.0
            min_new_tokens=params.min_new_tokens,  # and this one at 0
            pad_token_id=pad_id,
            eos_token_id=eos_ids,
            **sampling,
        )
