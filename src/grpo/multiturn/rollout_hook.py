"""A user-owned rollout (TRL's ``rollout_func``): an external agent framework makes the completions, grpo
scores and trains on the exact tokens it returns.

The function is called as ``rollout_func(prompts, context)``: ``prompts`` are the step's prompts, each repeated
``num_generations`` times in a row (chat message lists, or text for plain-text data), and ``context`` a
``RolloutHookContext`` (tokenizer, sampling settings, seed, the run's engine for those who want it; the Python
API passes its ``GRPOTrainer`` instead, as TRL passes its trainer, with this context as ``rollout_context``). It returns
a dict with, per row, ``prompt_ids`` (list of ints), ``completion_ids`` (list of ints), ``logprobs`` (the
sampler's log-prob of each completion token, a list of floats, or None when not known) and optionally
``env_mask`` (TRL's name; ``loss_mask`` is accepted too): 1 on tokens the model sampled, 0 on tokens an
environment inserted. Any other key is a per-row list handed to the reward functions, as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from grpo.data import PromptTooLong, build_prompt_messages
from grpo.multiturn.driver import TurnsResult
from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation
from grpo.rollout.hf import left_pad

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


@dataclass
class RolloutHookContext:
    """What the hook gets beside the prompts (TRL passes its trainer; these are the parts a rollout needs)."""

    tokenizer: Any
    processing_class: Any  # the tokenizer, under TRL's name
    sampling: SamplingParams
    num_generations: int
    seed: int | None
    engine: Any  # the run's own engine (generate / generate_ids), to sample with the current policy


class RolloutHook:
    """``rollout(examples, ...)`` through a user function; ``engine`` stays for weight updates
    (``driver.sampling_engine``)."""

    def __init__(self, fn: Callable, engine, tokenizer, eos_ids: list[int]):
        self.fn, self.engine, self.tokenizer, self.eos_ids = fn, engine, tokenizer, eos_ids
        self.extra_columns: dict[str, list] = {}

    def rollout(self, examples: Sequence, system_prompt: str | None, max_prompt_length: int,
                params: SamplingParams, seed: int | None) -> TurnsResult:
        G = params.n
        prompts = [e.question if e.plain_text else build_prompt_messages(e, system_prompt)
                   for e in examples for _ in range(G)]
        name = getattr(self.fn, "__name__", repr(self.fn))
        output = self.fn(prompts, RolloutHookContext(self.tokenizer, self.tokenizer, params, G, seed, self.engine))
        if not isinstance(output, dict):
            raise ValueError(f"rollout_func {name} returned {type(output).__name__}; it must return a dict with "
                             f"{', '.join(REQUIRED)}")
        missing = [k for k in REQUIRED if k not in output]
        if missing:
            raise ValueError(f"rollout_func {name} must return keys {missing} in its output dict")
        n = len(prompts)
        for key, values in output.items():
            if values is not None and len(values) != n:
                raise ValueError(f"rollout_func {name}: {key!r} has {len(values)} rows for {n} prompts "
                                 f"({len(examples)} prompts x num_generations {G})")
        mask_key = "env_mask" if "env_mask" in output else "loss_mask"
        masks = output.get(mask_key)
        completions, logprobs = output["completion_ids"], output["logprobs"]
        for i, ids in enumerate(completions):
            if len(output["prompt_ids"][i]) > max_prompt_length:
                raise PromptTooLong(f"rollout_func {name}: row {i}", len(output["prompt_ids"][i]), max_prompt_length,
                                    "prompt_ids")
            if len(ids) > params.max_tokens:
                raise ValueError(f"rollout_func {name}: row {i} has {len(ids)} completion tokens, over "
                                 f"rollout.max_completion_length {params.max_tokens}")
            for key, values in ((mask_key, masks), ("logprobs", logprobs)):
                if values is not None and values[i] is not None and len(values[i]) != len(ids):
                    raise ValueError(f"rollout_func {name}: row {i}'s {key} has {len(values[i])} values for "
                                     f"{len(ids)} completion tokens")
            if not ids or (masks is not None and not any(masks[i])):  # every loss term averages over these
                raise ValueError(f"rollout_func {name}: row {i} has no sampled token (an empty completion or "
                                 f"{mask_key} all 0); return at least the model's end-of-turn token")
        self.extra_columns = {k: list(v) for k, v in output.items() if k not in (*REQUIRED, "env_mask", "loss_mask")}
        generation = self._generation(output["prompt_ids"], completions, logprobs, masks)
        rendered = [self.tokenizer.decode(ids) for ids in output["prompt_ids"][::G]]
        return TurnsResult(generation, rendered, prompts, None)

    def _generation(self, prompt_ids, completions, logprobs, masks) -> Generation:
        pad = self.tokenizer.pad_token_id
        width = max(1, max(len(c) for c in completions))
        p_ids, p_mask = left_pad([list(p) for p in prompt_ids], pad)

        def right(values, fill):
            return list(values) + [fill] * (width - len(values))

        ids = torch.tensor([right(c, pad) for c in completions], dtype=torch.long)
        mask = torch.tensor([right([1] * len(c), 0) for c in completions], dtype=torch.long)
        loss_mask = (torch.tensor([right([int(bool(x)) for x in m], 0) for m in masks], dtype=torch.long)
                     if masks is not None else None)
        has_logprobs = logprobs is not None and all(lp is not None for lp in logprobs)
        truncated = torch.tensor([not c or c[-1] not in self.eos_ids for c in completions])
        return Generation(p_ids, p_mask, ids, mask, truncated,
                          self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                          sampler_logprobs=(torch.tensor([right(lp, 0.0) for lp in logprobs], dtype=torch.float32)
                                            if has_logprobs else None),
                          loss_mask=loss_mask)
