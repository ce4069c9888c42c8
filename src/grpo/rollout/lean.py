"""A lean sampling loop over a Hugging Face model's KV cache (the default ``hf`` engine).

Why not ``model.generate``: for the small models GRPO is often run with, its per-token Python
machinery (logits processors, stopping criteria, cache bookkeeping) costs as much as the model. This
loop does only what GRPO sampling needs, and samples from exactly the same distribution: the
repetition penalty and min_new_tokens on the raw logits, then logits / temperature, top-k, top-p and
min-p (the order ``generate`` applies them; ``grpo.algorithm.processing`` has the first two and
min-p), then one draw from that distribution (inverse CDF, see ``draw_tokens``). Three savings ``generate`` does not make:
each prompt is prefilled once and its KV cache repeated for the G samples (into a preallocated cache
written in place), finished rows leave the batch, and a LoRA policy samples with its
adapter folded into the weights it adapts (``grpo.rollout.folded_lora``: W + BA computed once per
call, and again when a newer adapter is loaded in flight, instead of two extra matmuls per layer
per token; the base weights themselves are never modified).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from grpo.algorithm.processing import eos_mask, min_p_removed, penalize_repeats, prompt_presence
from grpo.compat import cache_argument
from grpo.models.routing_replay import Recording
from grpo.models.wrappers import eos_token_ids, unwrap_model
from grpo.rollout.engine import SamplingParams, completion_mask_from_ids
from grpo.rollout.folded_lora import FoldedLora
from grpo.rollout.generation import Generation
from grpo.rollout.hf import eval_mode, left_pad
from grpo.rollout.in_flight import InFlight, TokenRecord, sample_in_calls, with_records
from grpo.rollout.prefill import prefill
from grpo.rollout.prefix_cache import CachedTurns, PrefixCache, cached_turns


def apply_processors(logits: Tensor, penalty: float, seen: Tensor | None, forbidden: Tensor | None) -> Tensor:
    """``generate``'s processors on [B, V] raw logits, before temperature: the repetition penalty over
    ``seen`` ([B, V] bool: the row's prompt and completion tokens so far; None = off), then -inf on
    ``forbidden`` ([V] or [B, V] bool: the EOS ids while min_new_tokens holds; None = nothing). With
    neither, the logits come back as they are (no copy: sampling without controls pays nothing); else a
    float32 copy."""
    if seen is None and forbidden is None:
        return logits
    logits = logits.float()
    if seen is not None:
        logits = penalize_repeats(logits, seen, penalty)
    if forbidden is not None:
        logits = logits.masked_fill(forbidden, float("-inf"))
    return logits


def filter_logits(logits: Tensor, temperature: float, top_k: int | None, top_p: float, min_p: float = 0.0) -> Tensor:
    """[B, V] logits -> [B, V] logits of the sampling distribution (-inf where excluded): temperature,
    top-k, top-p, min-p, in ``generate``'s order."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        logits = logits.masked_fill(min_p_removed(logits, min_p), float("-inf"))
    return logits


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer with room for ``capacity`` positions from the start: a decode step writes its
    column in place, where ``DynamicLayer`` re-copies the whole cache with ``torch.cat`` every token
    (30% of a sampling step for a small model). ``keys``/``values`` are views of the filled part, so
    the attention and mask code see exactly what a ``DynamicLayer`` would hold."""

    def __init__(self, keys: Tensor, values: Tensor, repeats: int, capacity: int):
        super().__init__()
        U, heads, length, _ = keys.shape  # [U, h, L, d]: one row per prompt, repeated for its samples
        self._keys = keys.new_empty(U * repeats, heads, capacity, keys.shape[-1])
        self._values = values.new_empty(U * repeats, heads, capacity, values.shape[-1])
        for buffer, filled in ((self._keys, keys), (self._values, values)):
            buffer.view(U, repeats, heads, capacity, -1)[:, :, :, :length] = filled[:, None]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        if length > self._keys.shape[2]:
            raise RuntimeError(f"KV cache of {self._keys.shape[2]} positions cannot hold {length}")
        self.length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        start, new = self.length, key_states.shape[-2]
        self._set_length(start + new)
        self._keys[:, :, start:start + new] = key_states
        self._values[:, :, start:start + new] = value_states
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        def select(buffer: Tensor) -> Tensor:  # only the filled positions are copied
            kept = buffer.new_empty(len(indices), *buffer.shape[1:])
            kept[:, :, :self.length] = buffer[indices, :, :self.length]
            return kept
        self._keys, self._values = select(self._keys), select(self._values)
        self._set_length(self.length)


def draw_tokens(probs: Tensor, generator: torch.Generator) -> Tensor:
    """[B, V] probabilities (rows summing to 1, zeros allowed) -> [B] token ids, one draw per row.

    Inverse-CDF sampling with one uniform per row: the same distribution as ``torch.multinomial(probs,
    1)``, which on CPU draws B * V exponentials (40% of a sampling step at an 8k vocabulary, far more at
    Qwen's 152k). The CDF is float64 so that its rounding is far below any token's probability that
    matters, and ``right=True`` never lands on a zero-probability token (its CDF equals the previous).
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)  # [B, 1]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)


def seeded_generator(params: SamplingParams, seed: int | None, device) -> torch.Generator:
    """The call's generator: ``seed``, or (sampling without one) a seed drawn from the caller's global
    stream, as ``generate()`` would use it."""
    generator = torch.Generator(device=device)
    if seed is None and not (params.greedy or params.temperature == 0):
        seed = int(torch.randint(0, 2**62, (1,)).item())
    generator.manual_seed(seed or 0)
    return generator


def assemble_generation(chunks: list[Tensor], encoded: list[list[int]], n: int, eos_ids: list[int], pad_id: int,
                        tokenizer) -> Generation:
    """Sampled batches ([b, t_i] tokens each, rows grouped per prompt) -> one ``Generation``: padded to
    the widest, masked up to and including each row's first EOS (what follows becomes padding), with
    the left-padded prompts repeated for their ``n`` rows."""
    width = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    prompt_ids, prompt_mask = left_pad(encoded, pad_id)
    return Generation(
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0), prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated,
        completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True))


def assemble_routing(parts: list[tuple[list[Tensor], Tensor]], n: int, prompt_width: int,
                     completion_width: int) -> Tensor:
    """The calls' recorded routing -> ``Generation.routing`` [N, Lp + Lc, layers, k] int16: each call's prompts'
    (one [len_i, layers, k] per prompt, its real tokens) left-padded to ``prompt_width`` and repeated for their
    ``n`` rows, its completions' [b, t, layers, k] right-padded to ``completion_width``; -1 where none was
    recorded."""
    prompts = [p for prompt_parts, _ in parts for p in prompt_parts]
    layers_k = prompts[0].shape[1:]
    padded = torch.full((len(prompts), prompt_width, *layers_k), -1, dtype=torch.int16)
    for row, p in enumerate(prompts):
        padded[row, prompt_width - p.shape[0]:] = p
    completions = torch.cat([torch.nn.functional.pad(c, (0, 0, 0, 0, 0, completion_width - c.shape[1]), value=-1)
                             for _, c in parts])
    return torch.cat([padded.repeat_interleave(n, dim=0), completions], dim=1)


class LeanEngine:
    """``RolloutEngine`` with the lean loop; same constructor and output as ``HFEngine``. ``record_routing``: an
    MoE policy's routing of every token it feeds is kept in ``Generation.routing`` (``loss.routing_replay``;
    the prompts are then prefilled in one padded pass, which the recording lines up with)."""

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int | None = None,
                 record_routing: bool = False):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.record_routing = record_routing
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no pad token; set one (e.g. the EOS)")

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        """``params.n`` completions per rendered prompt, rows grouped per prompt. ``seed`` fixes the draws."""
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None = None, *,
                     prefix_cache: PrefixCache | None = None, in_flight: InFlight | None = None) -> Generation:
        """``generate`` from token ids. ``prefix_cache`` (from ``cached_turns()``): each prompt continues from
        the longest stored row it extends, and every row's keys/values are stored when it stops. ``in_flight``:
        newer weights are loaded between decode steps (``generate_in_flight``)."""
        model = unwrap_model(self.model)
        pad_id = self.tokenizer.pad_token_id
        eos_ids = eos_token_ids(model, self.tokenizer)
        encoded = [list(ids) for ids in prompt_ids]
        generator = seeded_generator(params, seed, next(model.parameters()).device)
        per_call = max(1, (self.batch_size or len(encoded) * params.n) // params.n)
        with eval_mode(model), torch.no_grad():
            # LoRA: the adapter layers off, their base weights replaced by W + delta for the call (refolded when
            # a newer adapter is loaded in flight)
            lora = FoldedLora.of(model, in_flight)
            if lora is not None and in_flight is not None:
                in_flight = lora.following()
            recording = Recording(model) if self.record_routing else None
            routing: list[tuple[list[Tensor], Tensor]] = []
            with lora.swapped() if lora is not None else nullcontext(), \
                    recording.hooks() if recording is not None else nullcontext():
                chunks, records = sample_in_calls(
                    encoded, per_call, params, in_flight, next(model.parameters()).device, lambda prompts, record: (
                        self._sample(model, model, prompts, params, eos_ids, pad_id, generator, prefix_cache, record,
                                     recording, routing)))
        generation = assemble_generation(chunks, encoded, params.n, eos_ids, pad_id, self.tokenizer)
        if recording is not None:
            generation.routing = assemble_routing(routing, params.n, generation.prompt_ids.shape[1],
                                                  generation.completion_ids.shape[1])
        return with_records(generation, records) if records else generation

    def generate_in_flight(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None,
                           in_flight: InFlight, prefix_cache: PrefixCache | None = None) -> Generation:
        """See ``grpo.rollout.in_flight.InFlightCapable``."""
        return self.generate_ids(prompt_ids, params, seed, in_flight=in_flight, prefix_cache=prefix_cache)

    def cached_turns(self) -> AbstractContextManager[CachedTurns]:
        """See ``grpo.rollout.engine.PrefixCachingEngine``: the rows' keys/values kept between calls."""
        return cached_turns(self)

    @staticmethod
    def _sample(forward, model, encoded: list[list[int]], params: SamplingParams, eos_ids: list[int], pad_id: int,
                generator: torch.Generator, prefix_cache: PrefixCache | None = None,
                record: TokenRecord | None = None, recording: Recording | None = None,
                routing: list[tuple[list[Tensor], Tensor]] | None = None) -> Tensor:
        """One call's samples [B, t]; with ``recording`` (its hooks open), the call's routing is appended to
        ``routing``: (each prompt's [len_i, layers, k], the completions' [B, t, layers, k], -1 where not fed)."""
        device = next(model.parameters()).device
        first = prefill(forward, encoded, pad_id, device, prefix_cache, plain=recording is not None)
        cache, width = first.cache, first.key_mask.shape[1]
        n = params.n
        if recording is not None:  # the padded prompts' [U, W] tokens, row-major
            taken = recording.take().to(torch.int16)
            prompt_routing = taken.view(*first.prompt_ids.shape, *taken.shape[1:]).cpu()  # [U, W, layers, k]
            fed = torch.full((len(encoded) * n, params.max_tokens, *taken.shape[1:]), -1, dtype=torch.int16)
        # One prefill per prompt, its cache repeated for the G samples with room for their tokens. Other
        # layer kinds (sliding windows drop old positions) keep their own semantics, repeated as they are.
        cache.layers = [PreallocatedLayer(layer.keys, layer.values, n, width + params.max_tokens)
                        if type(layer) is DynamicLayer else layer for layer in cache.layers]
        for layer in cache.layers:
            if not isinstance(layer, PreallocatedLayer):
                layer.batch_repeat_interleave(n)
        if not all(isinstance(layer, PreallocatedLayer) for layer in cache.layers):
            prefix_cache = None  # a sliding window has dropped positions: such rows are prefilled whole next turn
        mask = first.key_mask.repeat_interleave(n, dim=0)  # [B, W] with B = prompts * n
        next_pos = first.last_position.repeat_interleave(n, dim=0) + 1  # [B, 1]
        logits = first.logits.repeat_interleave(n, dim=0)  # [B, V]
        B, V = logits.shape
        # The processors' state: the tokens each row has seen (prompt, then each drawn one) and the EOS ids
        seen = (prompt_presence(first.prompt_ids, first.prompt_mask, V).repeat_interleave(n, dim=0)  # [B, V] bool
                if params.repetition_penalty != 1.0 else None)
        eos_forbidden = eos_mask(eos_ids, V, device) if params.min_new_tokens > 0 else None  # [V]
        result = torch.full((B, params.max_tokens), pad_id, dtype=torch.long, device=device)
        active = torch.arange(B, device=device)  # rows still generating
        eos = torch.tensor(eos_ids, device=device)
        greedy = params.greedy or params.temperature == 0
        for t in range(params.max_tokens):
            logits = apply_processors(logits, params.repetition_penalty, seen,
                                      eos_forbidden if t < params.min_new_tokens else None)
            if greedy:
                tokens = logits.argmax(-1)
            else:
                probs = filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)
                tokens = draw_tokens(probs, generator)  # [b]
            result[active, t] = tokens
            if record is not None:
                record.drawn(active, t, tokens, logits)
            if seen is not None:
                seen.scatter_(1, tokens[:, None], True)
            done = torch.isin(tokens, eos)
            if done.all() or t == params.max_tokens - 1:
                if prefix_cache is not None:
                    _store_rows(prefix_cache, cache, torch.arange(len(active), device=device), mask, active,
                                result, t, encoded, n)
                break
            if done.any():  # finished rows leave the batch (their cache rows too)
                if prefix_cache is not None:  # ... after their keys/values are kept for their next turn
                    _store_rows(prefix_cache, cache, done.nonzero().squeeze(-1), mask, active, result, t, encoded, n)
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
                seen = seen[keep] if seen is not None else None
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            if record is not None:
                record.before_next(t)  # newer weights, if any, make the next token's logits
            out = forward(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos,
                          **cache_argument(cache), use_cache=True)
            if recording is not None:  # token t of the active rows, fed
                fed[active.cpu(), t] = recording.take().to(torch.int16).cpu()
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        if recording is not None:
            mask_rows = first.prompt_mask.bool().cpu()
            routing.append(([prompt_routing[i][mask_rows[i]] for i in range(len(encoded))], fed[:, : t + 1]))
        return result[:, : t + 1].cpu()


def _store_rows(prefix_cache: PrefixCache, cache, rows: Tensor, mask: Tensor, active: Tensor, result: Tensor, t: int,
                encoded: list[list[int]], n: int) -> None:
    """Keep batch rows ``rows`` at token ``t``: their cache holds the prompt and tokens 0..t-1 (token t was
    drawn, not fed), in the slots ``mask`` [b, W + t] marks."""
    fed = result[active[rows], :t].tolist()
    ids = [encoded[int(r) // n] + tokens for r, tokens in zip(active[rows].tolist(), fed)]
    prefix_cache.store(cache.layers, rows, mask[rows].bool(), ids)
