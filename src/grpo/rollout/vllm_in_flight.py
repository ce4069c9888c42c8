"""vLLM generation with newer weights loaded between its engine steps (``decoupled.weight_update: in_flight`` and
partial rollouts with ``rollout.engine: vllm``; ``grpo.rollout.in_flight`` says what is recorded per token).

The requests go to vLLM's engine one row each (row ``r`` of prompt ``i`` seeded ``seed + r``, as ``generate``
seeds vLLM's ``n`` samples), returning their new tokens at every ``step()``; each ``step()`` is one scheduler step
of the in-process engine core (``VLLMEngine(in_flight=True)``), so the tokens a step returns were drawn by the
weights loaded before it. Every ``check_tokens`` tokens ``in_flight.refresh()`` may load a newer version while
the requests are open:

* full weights reload in place (``VLLMEngine.update_weights``) and the open requests keep their KV caches, as the
  HF engines do;
* a LoRA adapter is bound to a request for the request's life in vLLM, so after an adapter load the open rows are
  re-admitted under the new adapter as prompts ending in their tokens so far: their KV caches are recomputed by
  the new adapter (one prefill of each open row per load; vLLM's prefix cache keys blocks by adapter, so none of
  the old adapter's blocks is reused), and the old adapter is removed once no request holds it. A re-admitted
  row draws from a seed of its own (the row's seed and its token count), not its first draws again.

The generation carries each token's version and vLLM's processed log-prob of it (``log_softmax(logits / T)`` with
top-k/top-p off). A partial rollout's carried row comes as a prompt ending in its tokens so far: vLLM's prefix
caching keeps their KV blocks until a weight load between chunks resets it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation
from grpo.rollout.in_flight import InFlight, TokenRecord, with_records

if TYPE_CHECKING:
    from grpo.rollout.vllm_engine import VLLMEngine

RESEED_STRIDE = 1_000_003  # a re-admitted row's seed: seed + r + stride * tokens so far (no other row's seed)


def generate_in_flight(owner: "VLLMEngine", encoded: list[list[int]], params: SamplingParams, seed: int | None,
                       in_flight: InFlight) -> Generation:
    """``params.n`` completions of each prompt in ``encoded`` (token ids), rows grouped per prompt, with every
    token's version and processed log-prob (``Generation.token_versions`` / ``sampler_logprobs``)."""
    n, engine = params.n, owner.llm.llm_engine
    one = dataclasses.replace(params, n=1)
    record = TokenRecord(in_flight, len(encoded) * n, params.max_tokens, params.temperature, "cpu")
    started = record.version
    call = owner.next_request_call()
    rows: list[list[int]] = [[] for _ in range(len(encoded) * n)]
    open_rows: dict[str, int] = {}  # open request id -> row
    admitted = itertools.count()  # request ids are never reused, not even by a re-admitted row that drew nothing

    def admit(r: int, adapter) -> None:  # row r's request from its tokens so far, under ``adapter``
        done = len(rows[r])
        row_seed = None if seed is None else seed + r + RESEED_STRIDE * done  # at first admission: seed + r
        rest = dataclasses.replace(one, max_tokens=params.max_tokens - done,
                                   min_new_tokens=max(0, params.min_new_tokens - done))
        sampling = owner.step_request_params(rest, row_seed)
        request_id = f"grpo-inflight-{call}-{r}-{next(admitted)}"  # outputs carry it (add_request's may differ)
        engine.add_request(request_id, {"prompt_token_ids": encoded[r // n] + rows[r]}, sampling,
                           lora_request=adapter)
        open_rows[request_id] = r

    adapter = owner.lora_request
    for r in range(len(rows)):
        admit(r, adapter)
    stopped = [False] * len(rows)
    owner.open_in_flight = True
    try:
        checked = 0  # tokens drawn when the last check ran
        while open_rows:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM dropped requests {sorted(open_rows)} without a final output")
            for output in engine.step():
                r = open_rows.get(output.request_id)
                if r is None:  # a request aborted for re-admission: what it still reports is not kept
                    continue
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                for token, logprob in zip(tokens, sampled_logprobs(completion.logprobs, tokens)):
                    record.scored(r, len(rows[r]), logprob)
                    rows[r].append(token)
                if output.finished:
                    stopped[r] = completion.finish_reason == "stop"
                    del open_rows[output.request_id]
            while open_rows and max(map(len, rows)) >= checked + in_flight.check_tokens:
                checked += in_flight.check_tokens
                record.before_next(checked - 1)
            if owner.lora_request is not adapter and open_rows:  # a newer adapter: the open rows go over to it
                adapter, readmitted = owner.lora_request, sorted(open_rows.values())
                engine.abort_request(list(open_rows))
                open_rows.clear()
                for r in readmitted:
                    admit(r, adapter)
                owner.remove_retired_adapters()
    finally:  # an error mid-loop (a failed load) must not leave requests running into the next call
        owner.open_in_flight = False
        if open_rows:
            engine.abort_request(list(open_rows))
        owner.remove_retired_adapters()
        if record.version != started:  # the loads could not reset it while the requests held their blocks
            owner.llm.reset_prefix_cache()
    generation = owner.as_generation(encoded, n, rows, [[] for _ in rows], stopped)
    return with_records(generation, [record.taken(generation.completion_ids.shape[1])])


def sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """vLLM's per-position ``{token_id: Logprob}`` dicts -> the sampled token's log-prob per position."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although logprobs=0 was requested")
    return [float(position[token].logprob) for position, token in zip(logprobs, token_ids)]
