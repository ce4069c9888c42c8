"""``hf-static``: sampling with a static KV cache and one decode step replayed as a CUDA graph.

Why: on a GPU the ``hf`` engine (``LeanEngine``) is bound by the host, not the GPU: every decode token
re-enters the model's Python, launches hundreds of small kernels, and checks the batch for EOS (a host
sync), so host time per token far exceeds the GPU's (docs/device-choices.md). Here everything that
changes from token to token lives in tensors at fixed addresses, so the whole step (model forward over
the static cache, temperature/top-k/top-p, the draw, writing the token) is one function of those
buffers, captured once per ``generate`` call as a CUDA graph and replayed per token: one launch per
token, and a host sync only every ``eos_check_every`` tokens to stop when every row has ended.

Data flow for one call (rows grouped per prompt, ``B = prompts * n``):
  prompts -> prefill each prompt once (dynamic cache, the sampling copy) -> its keys/values copied into
  ``[B, heads, C, d]`` buffers, ``C`` = prompt width + max tokens rounded up to ``CACHE_BUCKET`` ->
  ``max_tokens`` replays of ``step`` -> ``[B, max_tokens]`` tokens, everything after a row's first EOS
  replaced by padding (finished rows keep decoding, unused: a fixed shape costs less than a host sync).

The sampling distribution is the ``hf`` engine's: ``apply_processors`` (repetition penalty over a
``[B, V]`` bool of the tokens each row has seen, updated in place by the step; EOS at -inf while the
token index, a tensor, is below min_new_tokens: no host read), ``filter_logits`` (temperature, top-k,
top-p, min-p) and an inverse-CDF draw with one uniform per row and token. The uniforms are drawn up front,
``[B, max_tokens]`` from the call's seeded generator (no RNG inside the graph), so a seed fixes the
output; it is not the ``hf`` engine's stream, so the two engines give different (equally distributed)
samples for one seed. Weights: a ``SamplingCopy`` (bf16 on CUDA, LoRA merged), refreshed from the
policy at the start of every call, and in flight (``generate_in_flight``) whenever a check between two
decode steps loads a newer version: in place, so the captured graph reads the new weights (each token's
version and log-prob are then written by the step itself: ``TokenRecord.drawn_in_step``). The log-probs
the trainer recomputes come from the fp32 policy under autocast, so they differ from the bf16 sampler's
by bf16 rounding (as with vLLM); ``rollout/logprob_diff`` is the place to see that.

The graph is captured per call, not kept across calls, on purpose: a kept graph needs its buffers kept,
i.e. the static KV cache held through every update (GBs at the 1.5B-7B shapes), against the target of a
peak no higher than TRL's, while a capture costs only about two eager steps of host time per call (the
figures: docs/device-choices.md).

On a CPU the same step runs eagerly (``decode_graph: eager``; CUDA graphs need CUDA), or through
``torch.compile`` (``compile``): the tests use both to prove the step has no host sync or graph break.
"""

from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from grpo.algorithm.processing import eos_mask, prompt_presence
from grpo.compat import cache_argument
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation
from grpo.rollout.in_flight import InFlight, TokenRecord, sample_in_calls, with_records
from grpo.rollout.lean import apply_processors, assemble_generation, filter_logits, seeded_generator
from grpo.rollout.prefill import prefill
from grpo.rollout.prefix_cache import CachedTurns, PrefixCache, cached_turns
from grpo.rollout.sampling_copy import SamplingCopy

CACHE_BUCKET = 128  # cache lengths rounded up to this: steps with slightly different prompt widths reuse shapes
DECODE_GRAPHS = ("cuda-graph", "compile", "eager")


class StaticKVLayer(DynamicLayer):
    """One layer's keys/values in ``[B, heads, C, d]`` buffers that never move. ``update`` writes the new
    position at ``write_pos`` (a 0-d tensor shared by all layers, advanced by the step itself) and returns
    the whole buffer: positions not yet written are hidden by the step's attention mask."""

    def __init__(self, keys: Tensor, values: Tensor, repeats: int, capacity: int, write_pos: Tensor):
        super().__init__()
        U, heads, length, _ = keys.shape  # [U, h, Lp, d]: one row per prompt, repeated for its samples
        self.keys = keys.new_zeros(U * repeats, heads, capacity, keys.shape[-1])
        self.values = values.new_zeros(U * repeats, heads, capacity, values.shape[-1])
        for buffer, filled in ((self.keys, keys), (self.values, values)):
            buffer.view(U, repeats, heads, capacity, -1)[:, :, :, :length] = filled[:, None]
        self.write_pos = write_pos
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        index = self.write_pos.view(1)
        self.keys.index_copy_(2, index, key_states)  # key_states [B, h, 1, d]
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values


class StaticEngine:
    """``RolloutEngine`` for CUDA: static cache, graph-replayed decode step, bf16 sampling copy.

    Args:
        model: the policy (plain, peft LoRA or DDP-wrapped); sampled through a ``SamplingCopy``.
        tokenizer: needs a pad token.
        batch_size: completions per decode batch (``rollout.generation_batch_size``); None = all.
        dtype: the sampling copy's dtype; None = bf16 on CUDA, the policy's dtype elsewhere.
        decode_graph: "cuda-graph" (CUDA only), "compile" (``torch.compile`` of the step) or "eager";
            None = cuda-graph on CUDA, eager elsewhere.
        eos_check_every: tokens between the host's checks whether every row has ended.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int | None = None, *,
                 dtype: torch.dtype | None = None, decode_graph: str | None = None, eos_check_every: int = 16):
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no pad token; set one (e.g. the EOS)")
        device = next(model.parameters()).device
        on_cuda = device.type == "cuda"
        decode_graph = decode_graph or ("cuda-graph" if on_cuda else "eager")
        if decode_graph not in DECODE_GRAPHS:
            raise ValueError(f"unknown decode_graph {decode_graph!r}; known: {list(DECODE_GRAPHS)}")
        if decode_graph == "cuda-graph" and not on_cuda:
            raise ValueError("decode_graph 'cuda-graph' needs the model on a CUDA device; use 'compile' or 'eager'")
        self.policy, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.decode_graph, self.eos_check_every = decode_graph, eos_check_every
        first = next(model.parameters())
        self.copy = SamplingCopy(model, dtype or (torch.bfloat16 if on_cuda else first.dtype))
        self.graph_failure: str | None = None  # why capture failed once (then the step runs eagerly)

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        """``params.n`` completions per rendered prompt, rows grouped per prompt. ``seed`` fixes the draws."""
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None = None, *,
                     prefix_cache: PrefixCache | None = None, in_flight: InFlight | None = None) -> Generation:
        """``generate`` from token ids. ``prefix_cache`` (from ``cached_turns()``): each prompt continues from
        the longest stored row it extends, and every row's keys/values up to its first EOS are stored.
        ``in_flight``: newer weights are loaded between decode steps (``generate_in_flight``)."""
        if prefix_cache is not None:
            prefix_cache.check_open()
        if in_flight is None:
            self.copy.refresh()  # the policy may have been updated since the last call
        else:  # refreshed at the prefill's check (the same reason), then whenever a check loads a newer version
            in_flight = InFlight(in_flight.check_tokens, CopyFollowing(self.copy, in_flight.refresh).refresh)
        model = self.copy.model
        device = next(model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        eos_ids = eos_token_ids(self.policy, self.tokenizer)
        encoded = [list(ids) for ids in prompt_ids]
        generator = seeded_generator(params, seed, device)
        per_call = max(1, (self.batch_size or len(encoded) * params.n) // params.n)
        with torch.no_grad():
            chunks, records = sample_in_calls(encoded, per_call, params, in_flight, device, lambda prompts, record: (
                self._sample(model, prompts, params, eos_ids, pad_id, generator, prefix_cache, record)))
        generation = assemble_generation(chunks, encoded, params.n, eos_ids, pad_id, self.tokenizer)
        return with_records(generation, records) if records else generation

    def generate_in_flight(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None,
                           in_flight: InFlight, prefix_cache: PrefixCache | None = None) -> Generation:
        """See ``grpo.rollout.in_flight.InFlightCapable``."""
        return self.generate_ids(prompt_ids, params, seed, in_flight=in_flight, prefix_cache=prefix_cache)

    def cached_turns(self) -> AbstractContextManager[CachedTurns]:
        """See ``grpo.rollout.engine.PrefixCachingEngine``: the rows' keys/values kept between calls."""
        return cached_turns(self)

    def _sample(self, model, encoded: list[list[int]], params: SamplingParams, eos_ids: list[int], pad_id: int,
                generator: torch.Generator, prefix_cache: PrefixCache | None = None,
                record: TokenRecord | None = None) -> Tensor:
        """[B, t] sampled tokens (anything after a row's first EOS is unused) for one batch of prompts; ``record``
        (in flight): each token's version and log-prob written by the step, newer weights loaded between steps."""
        device = next(model.parameters()).device
        n, steps = params.n, params.max_tokens
        first = prefill(model, encoded, pad_id, device, prefix_cache)
        mask = first.key_mask  # [U, Lp]: Lp the prefill's slots (a cached prefix and the fed rest)
        Lp = mask.shape[1]
        capacity = math.ceil((Lp + steps) / CACHE_BUCKET) * CACHE_BUCKET
        cache = first.cache
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError("rollout engine hf-static supports full-attention models only (this one has "
                             f"{sorted({type(layer).__name__ for layer in cache.layers})}); use rollout.engine: hf")
        write_pos = torch.tensor(Lp, device=device)  # [] the cache slot the next token goes to
        cache.layers = [StaticKVLayer(layer.keys, layer.values, n, capacity, write_pos) for layer in cache.layers]
        B = len(encoded) * n
        V = first.logits.shape[-1]
        greedy = params.greedy or params.temperature == 0
        state = _StepState(
            cache=cache, write_pos=write_pos, prompt_len=Lp,
            # attention: the prompt's real tokens and every generated slot; the causal part (slot <= the
            # one being written) is applied in the step
            key_mask=torch.cat([mask, mask.new_ones(mask.shape[0], capacity - Lp)], 1).bool().repeat_interleave(n, 0),
            first_position=first.last_position.repeat_interleave(n, dim=0) + 1,  # [B, 1]
            slots=torch.arange(capacity, device=device),  # [C]
            uniforms=(None if greedy else
                      torch.rand(B, steps, generator=generator, dtype=torch.float64, device=device)),  # [B, steps]
            result=torch.full((B, steps), pad_id, dtype=torch.long, device=device),  # [B, steps]
            finished=torch.zeros(B, dtype=torch.bool, device=device),  # [B]
            eos=torch.tensor(eos_ids, device=device), params=params,
            # the processors' state (None when off): tokens seen per row [B, V], the EOS ids [V]
            seen=(prompt_presence(first.prompt_ids, first.prompt_mask, V).repeat_interleave(n, 0)
                  if params.repetition_penalty != 1.0 else None),
            eos_forbidden=eos_mask(eos_ids, V, device) if params.min_new_tokens > 0 else None, record=record)
        # Token 0 comes from the prefill's logits (eagerly); the graph covers tokens 1 .. steps-1.
        state.first_token(first.logits.repeat_interleave(n, 0))
        step = self._decode_step(model, state)
        t = 0
        for t in range(1, steps):
            if record is not None:
                record.before_next(t - 1)  # newer weights, if any, are in the copy before the step reads it
            step()
            if t % self.eos_check_every == 0 and bool(state.finished.all()):  # the one host sync, every k tokens
                break
        if prefix_cache is not None:
            _store_rows(prefix_cache, state, encoded, n, t)
        return state.result[:, : t + 1].cpu()

    def _decode_step(self, model, state: "_StepState"):
        """The step to call once per token: a replayed CUDA graph, a compiled function or the plain one."""
        def step():
            state.step(model)

        if self.decode_graph == "eager":
            return step
        if self.decode_graph == "compile":
            return torch.compile(step, fullgraph=True, dynamic=False)
        try:
            return _capture(step, state)
        except RuntimeError as error:  # loud, once per engine: correct but slower from here on
            if self.graph_failure is None:
                warnings.warn(f"rollout engine hf-static: CUDA graph capture failed ({error}); decoding eagerly",
                              RuntimeWarning, stacklevel=2)
            self.graph_failure = str(error)
            return step


class _StepState:
    """The fixed-address tensors one decode step reads and writes (see ``StaticEngine._sample``)."""

    def __init__(self, *, cache, write_pos: Tensor, prompt_len: int, key_mask: Tensor, first_position: Tensor,
                 slots: Tensor, uniforms: Tensor | None, result: Tensor, finished: Tensor,
                 eos: Tensor, params: SamplingParams, seen: Tensor | None, eos_forbidden: Tensor | None,
                 record: TokenRecord | None = None):
        self.cache, self.write_pos, self.prompt_len = cache, write_pos, prompt_len
        self.token_record = record  # None unless in flight: then every token's version and log-prob
        self.key_mask, self.first_position, self.slots = key_mask, first_position, slots
        self.uniforms, self.result, self.finished, self.eos, self.params = uniforms, result, finished, eos, params
        self.seen, self.eos_forbidden = seen, eos_forbidden
        self.tokens = result[:, 0].clone()  # [B] the last token drawn (set by first_token)

    def draw(self, logits: Tensor, t: Tensor) -> Tensor:
        """[B, V] logits -> [B] tokens; ``t`` ([1]) picks this token's column of uniforms."""
        params = self.params
        # min_new_tokens: the EOS ids are out while t < min_new_tokens, decided on the device ([V] & [1])
        forbidden = None if self.eos_forbidden is None else self.eos_forbidden & (t < params.min_new_tokens)
        logits = apply_processors(logits, params.repetition_penalty, self.seen, forbidden)
        if self.uniforms is None:
            tokens = logits.float().argmax(-1)
        else:
            probs = filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)
            cdf = probs.double().cumsum(-1)  # [B, V]: the hf engine's inverse-CDF draw (lean.draw_tokens)
            u = self.uniforms.index_select(1, t)  # [B, 1]
            tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)
        if self.token_record is not None:
            self.token_record.drawn_in_step(t, tokens, logits)
        return tokens

    def record(self, tokens: Tensor, t: Tensor) -> None:
        self.tokens.copy_(tokens)
        self.result.index_copy_(1, t, tokens[:, None])
        self.finished |= torch.isin(tokens, self.eos)
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)

    def first_token(self, logits: Tensor) -> None:
        t = torch.zeros(1, dtype=torch.long, device=logits.device)
        self.record(self.draw(logits, t), t)

    def step(self, model) -> None:
        """Feed the last token at slot ``write_pos``, draw the next one, advance. No host sync."""
        t = (self.write_pos - self.prompt_len + 1).view(1)  # [1] index of the token drawn now
        visible = self.key_mask & (self.slots <= self.write_pos)  # [B, C]
        out = model(input_ids=self.tokens[:, None], position_ids=self.first_position + t - 1,
                    attention_mask=visible[:, None, None, :], **cache_argument(self.cache), use_cache=True)
        self.record(self.draw(out.logits[:, -1], t), t)
        self.write_pos.add_(1)


class CopyFollowing:
    """``refresh`` (an ``InFlight``'s) with the sampling copy rewritten from the policy, in place, at its first
    call and whenever it returns another version than the copy holds: ``refresh`` loads into the policy, and the
    captured decode step reads the copy's tensors at their addresses."""

    def __init__(self, copy: SamplingCopy, refresh):
        self.copy, self.in_flight_refresh, self.version = copy, refresh, None

    def refresh(self) -> int:
        version = self.in_flight_refresh()
        if version != self.version:
            self.copy.refresh()
            self.version = version
        return version


def _store_rows(prefix_cache: PrefixCache, state: "_StepState", encoded: list[list[int]], n: int, t: int) -> None:
    """Keep every row's keys/values after ``t`` decode steps: tokens 0..t-1 have been fed (slots Lp..Lp+t-1),
    but a row that ended keeps only those before its first EOS (it went on decoding, unused, after it)."""
    Lp, result = state.prompt_len, state.result[:, :t + 1]
    is_eos = torch.isin(result, state.eos)  # [B, t+1]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], t, dtype=torch.long))
    kept = first_eos.clamp(max=t)  # [B] generated tokens kept per row
    slots = state.slots[: Lp + t]  # [Lp + t]
    real = state.key_mask[:, : Lp + t] & (slots < Lp + kept[:, None])  # [B, Lp + t]
    ids = [encoded[r // n] + result[r, :k].tolist() for r, k in enumerate(kept.tolist())]
    prefix_cache.store(state.cache.layers, torch.arange(len(ids), device=result.device), real, ids)


def _capture(step, state: _StepState):
    """Capture ``step`` as a CUDA graph; returns the replay. The warm-up runs on a side stream (as
    torch.cuda.graphs requires) and its writes are undone by restoring the step's inputs."""
    restored = [state.write_pos, state.tokens, state.finished] + ([state.seen] if state.seen is not None else [])
    saved = [tensor.clone() for tensor in restored]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: lazy initialisation (cuBLAS handles, kernels) must not happen during capture
    torch.cuda.current_stream().wait_stream(stream)
    for tensor, value in zip(restored, saved):  # the warm-up's token must not count as seen either
        tensor.copy_(value)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # capture records without running: the state is still that before token 1
    return graph.replay
