"""A generate endpoint over the run's rollout engine, for agent programs that run their own episodes.

Routes (HTTP, JSON):

- ``POST /inference/v1/generate``: vLLM's token-in/token-out API, as ``renderers.client.generate`` (what
  verifiers' ``TrainClient`` calls) sends it: ``{"model", "token_ids": [int], "sampling_params": {"max_tokens",
  ...}}`` -> ``{"request_id", "prompt_token_ids", "choices": [{"index": 0, "token_ids": [int], "logprobs":
  {"content": [{"token": "token_id:<id>", "logprob": float}]}, "finish_reason": "stop"|"length"}], "usage"}``.
- ``POST /v1/chat/completions``: OpenAI's chat completions for programs that only speak that: the messages are
  rendered with the tokenizer's chat template, the reply is text (``choices[0].message.content``) plus
  ``prompt_token_ids``/``token_ids``/``logprobs`` as above.
- ``GET /v1/models``: the one model, with ``max_model_len`` (the run's prompt limit plus completion budget).

Every reply is sampled with the run's sampling settings (temperature, top-p/top-k...), whatever the request
asks: the trained tokens must come from the distribution the loss assumes. The run's completion budget
(``max_tokens``) holds per episode, as in a multi-turn row: a session's replies and the tokens between them
count toward it (a reply past it is empty, finish_reason "length"); a request's ``max_tokens`` can only lower it. The log-probs are the engine's own when it reports them (vLLM), else
``logprobs_fn``'s (the policy's, at the run's temperature). Every turn is recorded under the request's
``X-Session-ID`` header (verifiers sends its trace id there), so the caller reads back each episode's exact
tokens (``turns``) instead of re-tokenising text.
"""

import itertools
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

if TYPE_CHECKING:
    from fastapi import FastAPI

from grpo.algorithm.tokens import token_logprobs
from grpo.rollout.engine import SamplingParams, TokenIdsEngine

SESSION_HEADER = "X-Session-ID"  # verifiers.v1.clients.client.SESSION_ID_HEADER
NO_SESSION = ""  # turns of requests without the header

# (prompt ids, completion ids) -> the completion's log-probs, one per completion token
LogprobsFn = Callable[[list[int], list[int]], list[float]]


@dataclass(frozen=True)
class Turn:
    """One sampled reply: the exact prompt ids the engine read, the ids it sampled and their log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with an end-of-turn id (else cut by the token budget)


class GenerateEndpoint:
    """The routes above over ``engine`` (one request samples at a time: the engine is not re-entrant).

    Args:
        engine: the run's engine (``generate_ids``), used with ``params`` (its ``n`` is ignored: one reply).
        tokenizer: renders chat-completions requests and decodes replies.
        eos_ids: the ids that end a turn (``finish_reason`` "stop").
        logprobs_fn: log-probs for engines that report none (an HF engine samples from the policy itself).
        model_name: the name ``/v1/models`` reports; any ``model`` in a request is accepted.
        max_model_len: reported by ``/v1/models`` (renderers' pre-flight check of a prompt's length).
        seed: the first request's sampling seed; each later request takes the next one.
    """

    def __init__(self, engine: TokenIdsEngine, tokenizer, params: SamplingParams, eos_ids: list[int],
                 logprobs_fn: LogprobsFn | None, model_name: str, max_model_len: int, seed: int = 0):
        self.engine, self.tokenizer, self.params, self.eos_ids = engine, tokenizer, params, list(eos_ids)
        self.logprobs_fn, self.model_name, self.max_model_len = logprobs_fn, model_name, max_model_len
        self.seeds = itertools.count(seed)
        self.lock = threading.Lock()
        self.sessions: dict[str, list[Turn]] = {}
        self.engine_logprobs = False  # whether the last reply's log-probs were the engine's own (its own weights)
        self.app = self._build_app()

    def turns(self, session: str) -> list[Turn]:
        """The turns recorded under ``session``, in the order they were sampled ([] when none)."""
        with self.lock:
            return list(self.sessions.get(session, []))

    def clear(self) -> None:
        """Forget every recorded turn (a new step's episodes start)."""
        with self.lock:
            self.sessions.clear()

    def restart(self, params: SamplingParams, seed: int) -> None:
        """A new batch of episodes: no recorded turns, ``params`` for every reply, seeds from ``seed`` on."""
        with self.lock:
            self.sessions.clear()
            self.params, self.seeds = params, itertools.count(seed)

    def sample(self, prompt_ids: list[int], max_tokens: int | None, session: str,
               stop_ids: Sequence[int] = ()) -> Turn:
        """One reply to ``prompt_ids`` with the run's settings, recorded under ``session``. It ends at the
        first of the end-of-turn ids or ``stop_ids`` (vLLM's ``stop_token_ids``: the tokens after one are
        never sampled there, so cutting them here gives the reply vLLM would have given)."""
        if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ValueError("token_ids must be a non-empty list of integers")
        with self.lock:
            budget = self._budget(prompt_ids, session, max_tokens)
            if budget <= 0:  # the episode's completion budget is spent: an empty reply, cut by length
                turn = Turn(list(prompt_ids), [], [], False)
                self.sessions.setdefault(session, []).append(turn)
                return turn
            out = self.engine.generate_ids([list(prompt_ids)], replace(self.params, n=1, max_tokens=budget),
                                           seed=next(self.seeds))
            ids = out.completion_ids[0][out.completion_mask[0].bool()].tolist()
            stops = set(self.eos_ids) | {int(t) for t in stop_ids}
            ends = [i for i, t in enumerate(ids) if t in stops]
            ids = ids[:ends[0] + 1] if ends else ids
            self.engine_logprobs = out.sampler_logprobs is not None
            if self.engine_logprobs:
                logprobs = out.sampler_logprobs[0, :len(ids)].tolist()
            elif self.logprobs_fn is not None:
                logprobs = [float(x) for x in self.logprobs_fn(list(prompt_ids), ids)]
            else:
                raise RuntimeError("the engine reports no log-probs and the endpoint has no logprobs_fn")
            turn = Turn(list(prompt_ids), ids, logprobs, bool(ends))
            self.sessions.setdefault(session, []).append(turn)
        return turn

    def _budget(self, prompt_ids: list[int], session: str, max_tokens: int | None) -> int:
        """Tokens this reply may sample: the run's completion budget less what the session's episode already
        holds after its first prompt (replies and the tokens between them count, as in a multi-turn row),
        lowered by the request's ``max_tokens``."""
        earlier = self.sessions.get(session) if session != NO_SESSION else None
        used = max(0, len(prompt_ids) - len(earlier[0].prompt_ids)) if earlier else 0
        budget = self.params.max_tokens - used
        return budget if max_tokens is None else min(budget, max(1, int(max_tokens)))

    def _generate_reply(self, body: dict, session: str) -> dict:
        sampling = body.get("sampling_params") or {}
        turn = self.sample(body.get("token_ids") or [], sampling.get("max_tokens"), session,
                           sampling.get("stop_token_ids") or ())
        return {"request_id": f"grpo-{time.monotonic_ns()}", "prompt_token_ids": turn.prompt_ids,
                "choices": [{"index": 0, "token_ids": turn.completion_ids, "logprobs": _logprob_content(turn),
                             "finish_reason": "stop" if turn.finished else "length"}],
                "usage": _usage(turn)}

    def _chat_reply(self, body: dict, session: str) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        prompt_ids = list(self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=True,
                                                             add_generation_prompt=True, return_dict=False))
        turn = self.sample(prompt_ids, body.get("max_completion_tokens") or body.get("max_tokens"), session)
        text = self.tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
        return {"id": f"grpo-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop" if turn.finished else "length",
                             "logprobs": _logprob_content(turn), "token_ids": turn.completion_ids}],
                "prompt_token_ids": turn.prompt_ids, "usage": _usage(turn)}

    def _build_app(self) -> "FastAPI":
        # On first use: fastapi costs 0.4 s of import that only a run serving this endpoint pays. No
        # `from __future__ import annotations` in this module, so the handlers' `Request` is the class itself.
        from fastapi import FastAPI, Request  # on first use (above)
        from fastapi.responses import JSONResponse  # on first use (above)
        from starlette.concurrency import run_in_threadpool  # on first use (above)

        app = FastAPI()

        async def answer(request: Request, reply: Callable[[dict, str], dict]) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
            if not isinstance(body, dict):
                return JSONResponse({"error": {"message": "the body must be a JSON object"}}, status_code=400)
            session = request.headers.get(SESSION_HEADER, NO_SESSION)
            try:  # the engine runs on a worker thread: the server keeps answering while it samples
                return JSONResponse(await run_in_threadpool(reply, body, session))
            except (ValueError, TypeError) as error:
                return JSONResponse({"error": {"message": str(error)}}, status_code=400)

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            return await answer(request, self._generate_reply)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await answer(request, self._chat_reply)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "max_model_len": self.max_model_len}]}

        return app


def policy_logprobs(policy: torch.nn.Module, temperature: float) -> LogprobsFn:
    """A ``LogprobsFn`` from ``policy``'s forward pass at ``temperature`` (grpo's old log-probs' convention)."""

    def logprobs(prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        if not completion_ids:
            return []
        ids = torch.tensor([prompt_ids + completion_ids], device=next(policy.parameters()).device)  # [1, T]
        with torch.no_grad():
            logits = policy(input_ids=ids).logits  # [1, T, V]
        return token_logprobs(logits, ids, temperature)[0, len(prompt_ids) - 1:].tolist()

    return logprobs


def _logprob_content(turn: Turn) -> dict[str, Any]:
    return {"content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(turn.completion_ids, turn.logprobs)]}


def _usage(turn: Turn) -> dict[str, int]:
    return {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.completion_ids),
            "total_tokens": len(turn.prompt_ids) + len(turn.completion_ids)}


class EndpointServer:
    """``endpoint``'s app served by uvicorn on a loopback port, on a daemon thread; a context manager.
    ``base_url`` is ``http://127.0.0.1:<port>/v1`` (OpenAI clients' form; the generate route is at the root)."""

    def __init__(self, endpoint: GenerateEndpoint, host: str = "127.0.0.1", port: int = 0):
        self.endpoint = endpoint
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        import uvicorn  # on first use, as fastapi in GenerateEndpoint._build_app

        config = uvicorn.Config(endpoint.app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="grpo-generate-endpoint", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "EndpointServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the generate endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    def __enter__(self) -> "EndpointServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
