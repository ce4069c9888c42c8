"""Weights updated while a batch is generated (``decoupled.weight_update: in_flight``).

Every ``check_tokens`` decode steps the engine asks for the newest published weights; a newer version is loaded in
place into the module it samples with, and the open sequences continue. Their KV caches are kept, not recomputed:
the keys and values of the tokens so far stay those of the weights that read them, as in PipelineRL's in-flight
updates. Recomputing them would cost a prefill of every open sequence per update, and the trainer does not need
it: it recomputes every log-prob from the full sequence under its own weights, and what it must know (which
weights drew each token, and with what probability) is recorded per token here. Each token's version and the
log-prob its sampling distribution gave it (``log_softmax(processed logits / temperature)``, what the trainer's
log-probs compute, without top-k/top-p truncation) come back on the ``Generation``.

``hf-static`` samples from a copy of the policy (``SamplingCopy``): when a refresh loads a newer version into the
policy, the copy is rewritten from it in place before the next decode step (its tensors keep their addresses: the
captured CUDA graph reads them there); the KV caches are kept there too.
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
from grpo.rollout.prefix_cache import PrefixCache


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
        self.current = torch.tensor(self.version, device=device)  # the same, where a captured decode step reads it
        self.versions = torch.zeros(rows, max_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, max_tokens, dtype=torch.float32, device=device)

    def drawn(self, rows: Tensor, t: int, tokens: Tensor, logits: Tensor) -> None:
        """Token ``t`` of batch rows ``rows`` ([b]) is ``tokens`` ([b]), drawn from processed ``logits`` ([b, V])."""
        self.versions[rows, t] = self.version
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # [b, V]
        self.logprobs[rows, t] = logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def scored(self, row: int, t: int, logprob: float) -> None:
        """Token ``t`` of row ``row`` was drawn now, with ``logprob`` as its engine reports it (vLLM's processed
        log-prob, the same quantity when top-k/top-p are off)."""
        self.versions[row, t] = self.version
        self.logprobs[row, t] = logprob

    def drawn_in_step(self, t: Tensor, tokens: Tensor, logits: Tensor) -> None:
        """``drawn`` for every row, at token ``t`` given as a [1] tensor: no value is read back to the host, so a
        decode step captured as a CUDA graph can record (``hf-static``). ``tokens`` [B], ``logits`` [B, V]."""
        self.versions.index_copy_(1, t, self.current.expand(tokens.shape[0], 1))
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # [B, V]
        self.logprobs.index_copy_(1, t, logprobs.gather(-1, tokens[:, None]))

    def before_next(self, t: int) -> None:
        """Token ``t`` is drawn and the forward that makes token ``t + 1``'s logits comes next: the moment to
        load newer weights, every ``check_tokens`` tokens."""
        if (t + 1) % self.in_flight.check_tokens == 0:
            version = self.in_flight.refresh()
            if version != self.version:
                self.current.fill_(version)
            self.version = version

    def taken(self, width: int) -> tuple[Tensor, Tensor]:
        """The versions and log-probs of the first ``width`` tokens, on the CPU."""
        return self.versions[:, :width].cpu(), self.logprobs[:, :width].cpu()


def sample_in_calls(encoded: list[list[int]], per_call: int, params: SamplingParams, in_flight: InFlight | None,
                    device, sample: Callable[[list[list[int]], "TokenRecord | None"], Tensor]
                    ) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
    """An engine's calls of at most ``per_call`` prompts each: ``sample(prompts, record)`` -> [b, t] tokens, with a
    ``TokenRecord`` per call when ``in_flight`` (else None). Returns the calls' tokens and their records (versions,
    log-probs: ``with_records``' input; empty without ``in_flight``)."""
    temperature = 1.0 if params.greedy or params.temperature == 0 else params.temperature
    chunks, records = [], []
    for start in range(0, len(encoded), per_call):
        prompts = encoded[start:start + per_call]
        record = (TokenRecord(in_flight, len(prompts) * params.n, params.max_tokens, temperature, device)
                  if in_flight is not None else None)
        chunks.append(sample(prompts, record))
        if record is not None:
            records.append(record.taken(chunks[-1].shape[1]))
    return chunks, records


def with_records(generation: Generation, records: list[tuple[Tensor, Tensor]]) -> Generation:
    """``generation`` with the sampling calls' records ([b_i, t_i] versions and log-probs, rows in order) as its
    ``token_versions`` and ``sampler_logprobs``, padded to its width and 0 after each row's end."""
    width, mask = generation.completion_ids.shape[1], generation.completion_mask

    def joined(index: int) -> Tensor:
        return torch.cat([torch.nn.functional.pad(r[index], (0, width - r[index].shape[1])) for r in records])

    return replace(generation, token_versions=joined(0) * mask, sampler_logprobs=joined(1) * mask)


@runtime_checkable
class InFlightCapable(Protocol):
    """An engine that can load newer weights between its decode steps (``rollout.engine: hf``, ``hf-static`` or
    ``vllm``)."""

    def generate_in_flight(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None,
                           in_flight: InFlight, prefix_cache: PrefixCache | None = None) -> Generation:
        """``generate_ids`` with ``in_flight``'s updates; the ``Generation`` carries ``token_versions`` and
        ``sampler_logprobs``. ``prefix_cache``: rows continue from stored keys/values (``generate_ids``')."""
        ...


class InFlightEngine:
    """A rollout engine whose every call updates its weights in flight (``InFlight``)."""

    def __init__(self, engine: InFlightCapable, in_flight: InFlight, tokenizer):
        self.engine, self.in_flight, self.tokenizer = engine, in_flight, tokenizer

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None = None, *,
                     prefix_cache: PrefixCache | None = None) -> Generation:
        return self.engine.generate_in_flight(prompt_ids, params, seed, self.in_flight, prefix_cache)


def in_flight_engine(engine, in_flight: InFlight, tokenizer, engine_name: str,
                     setting: str = "decoupled.weight_update is in_flight") -> InFlightEngine:
    """``engine`` updated in flight; ConfigError when it cannot be (``engine_name``: the engine ``auto`` chose;
    ``setting``: the setting that asks for it, for the message)."""
    if not isinstance(engine, InFlightCapable):
        raise ConfigError(f"{setting} but the sampler's engine is {engine_name} ({type(engine).__name__}), which "
                          "does not load weights between decode steps (nor record each token's version and "
                          f"log-prob); set rollout.engine: hf, hf-static or vllm (or turn off {setting.split()[0]})")
    return InFlightEngine(engine, in_flight, tokenizer)
