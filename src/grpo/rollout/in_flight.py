"""Weights updated while a batch is generated (``decoupled.weight_update: in_flight``).

Every ``check_tokens`` decode steps the engine asks for the newest published weights; a newer version is loaded in
place into the module it samples with, and the open sequences continue. Their KV caches are kept, not recomputed:
the keys and values of the tokens so far stay those of the weights that read them, as in PipelineRL's in-flight
updates. Recomputing them would cost a prefill of every open sequence per update, and the trainer does not need
it: it recomputes every log-prob from the full sequence under its own weights, and what it must know (which
weights drew each token, and with what probability) is recorded per token here. Each token's version and the
log-prob its sampling distribution gave it (``log_softmax(processed logits / temperature)``, what the trainer's
log-probs compute, without top-k/top-p truncation) come back on the ``Generation``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from grpo.config import ConfigError
from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation


@dataclass(frozen=True)
class InFlight:
    """How an engine updates its weights mid-generation: ``refresh()`` loads the newest published weights in
    place when they are newer than the loaded ones and returns the loaded version (it never waits);
    ``check_tokens``: decode steps between two calls."""

    check_tokens: int
    refresh: Callable[[], int]


class TokenRecord:
    """One sampling call's per-token record: the version of the weights that drew each token and its log-prob,
    ``[B, T]`` each (B rows, T = max new tokens), written as tokens are drawn."""

    def __init__(self, in_flight: InFlight, rows: int, max_tokens: int, temperature: float, device):
        self.in_flight, self.temperature = in_flight, temperature
        self.version = in_flight.refresh()  # the weights the prefill runs with
        self.versions = torch.zeros(rows, max_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, max_tokens, dtype=torch.float32, device=device)

    def drawn(self, rows: Tensor, t: int, tokens: Tensor, logits: Tensor) -> None:
        """Token ``t`` of batch rows ``rows`` ([b]) is ``tokens`` ([b]), drawn from processed ``logits`` ([b, V])."""
        self.versions[rows, t] = self.version
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # [b, V]
        self.logprobs[rows, t] = logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def before_next(self, t: int) -> None:
        """Token ``t`` is drawn and the forward that makes token ``t + 1``'s logits comes next: the moment to
        load newer weights, every ``check_tokens`` tokens."""
        if (t + 1) % self.in_flight.check_tokens == 0:
            self.version = self.in_flight.refresh()

    def taken(self, width: int) -> tuple[Tensor, Tensor]:
        """The versions and log-probs of the first ``width`` tokens, on the CPU."""
        return self.versions[:, :width].cpu(), self.logprobs[:, :width].cpu()


def with_records(generation: Generation, records: list[tuple[Tensor, Tensor]]) -> Generation:
    """``generation`` with the sampling calls' records ([b_i, t_i] versions and log-probs, rows in order) as its
    ``token_versions`` and ``sampler_logprobs``, padded to its width and 0 after each row's end."""
    width, mask = generation.completion_ids.shape[1], generation.completion_mask

    def joined(index: int) -> Tensor:
        return torch.cat([torch.nn.functional.pad(r[index], (0, width - r[index].shape[1])) for r in records])

    return replace(generation, token_versions=joined(0) * mask, sampler_logprobs=joined(1) * mask)


@runtime_checkable
class InFlightCapable(Protocol):
    """An engine that can load newer weights between its decode steps (``rollout.engine: hf``)."""

    def generate_in_flight(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None,
                           in_flight: InFlight) -> Generation:
        """``generate_ids`` with ``in_flight``'s updates; the ``Generation`` carries ``token_versions`` and
        ``sampler_logprobs``."""
        ...


class InFlightEngine:
    """A rollout engine whose every call updates its weights in flight (``InFlight``)."""

    def __init__(self, engine: InFlightCapable, in_flight: InFlight, tokenizer):
        self.engine, self.in_flight, self.tokenizer = engine, in_flight, tokenizer

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     seed: int | None = None) -> Generation:
        return self.engine.generate_in_flight(prompt_ids, params, seed, self.in_flight)


def in_flight_engine(engine, in_flight: InFlight, tokenizer, engine_name: str) -> InFlightEngine:
    """``engine`` updated in flight; ConfigError when it cannot be (``engine_name``: the engine ``auto`` chose)."""
    if not isinstance(engine, InFlightCapable):
        raise ConfigError(f"decoupled.weight_update is in_flight but the sampler's engine is {engine_name} "
                          f"({type(engine).__name__}), which does not load weights between decode steps; set "
                          "rollout.engine: hf or decoupled.weight_update: per_chunk")
    return InFlightEngine(engine, in_flight, tokenizer)
