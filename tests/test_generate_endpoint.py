"""The generate endpoint (grpo.rollout.generate_endpoint) over a scripted engine: vLLM's /inference/v1/generate
as renderers' client (what verifiers' TrainClient calls) sends and parses it, OpenAI chat completions, the run's
settings over the request's, stop ids, each session's turns recorded exactly, and bad requests answered 400."""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch

from grpo.rollout.engine import SamplingParams
from grpo.rollout.generate_endpoint import EndpointServer, GenerateEndpoint
from grpo.rollout.generation import Generation

REPLY = [5, 6, 0, 7, 2, 9]  # 0: a renderer's stop id; 2: the model's EOS
EOS = [2]


class ScriptedEngine:
    """Answers every prompt with REPLY (cut to max_tokens), log-prob -0.1 * (position + 1); records its calls."""

    def __init__(self, own_logprobs: bool = True):
        self.calls: list[tuple[list[int], SamplingParams, int | None]] = []
        self.own_logprobs = own_logprobs

    def generate_ids(self, prompt_ids, params, seed=None) -> Generation:
        self.calls.append((list(prompt_ids[0]), params, seed))
        reply = REPLY[:params.max_tokens]
        ends = [i for i, t in enumerate(reply) if t in EOS]
        mask = [1 if not ends or i <= ends[0] else 0 for i in range(len(reply))]
        return Generation(torch.tensor([prompt_ids[0]]), torch.ones(1, len(prompt_ids[0]), dtype=torch.long),
                          torch.tensor([reply]), torch.tensor([mask]), torch.tensor([not ends]), ["text"],
                          sampler_logprobs=(torch.tensor([[-0.1 * (i + 1) for i in range(len(reply))]])
                                            if self.own_logprobs else None))


@pytest.fixture
def served(tiny_tokenizer):
    engine = ScriptedEngine()
    endpoint = GenerateEndpoint(engine, tiny_tokenizer, SamplingParams(max_tokens=5, temperature=0.7), EOS,
                                None, "grpo-policy", 1024, seed=11)
    with EndpointServer(endpoint) as server:
        yield engine, endpoint, server


def test_renderers_generate_client_gets_the_exact_tokens_and_logprobs(served, tiny_tokenizer):
    renderers_client = pytest.importorskip("renderers.client")
    from openai import AsyncOpenAI
    from renderers import create_renderer

    engine, endpoint, server = served
    renderer = create_renderer(tiny_tokenizer, None)

    async def call():
        return await renderers_client.generate(
            client=AsyncOpenAI(base_url=server.base_url, api_key="x"), renderer=renderer,
            messages=[{"role": "user", "content": "2+3?"}], model="anything",
            sampling_params={"max_tokens": 50, "temperature": 1.5}, extra_headers={"X-Session-ID": "episode-1"})

    result = asyncio.run(call())
    prompt = renderer.render([{"role": "user", "content": "2+3?"}], add_generation_prompt=True).token_ids
    assert renderer.get_stop_token_ids() == EOS  # the chat template's turn end
    expected = [5, 6, 0, 7, 2]  # up to the EOS, within the run's max_tokens 5 (the request's 50 cannot raise it)
    assert result["prompt_ids"] == list(prompt)
    assert result["completion_ids"] == expected
    assert result["completion_logprobs"] == pytest.approx([-0.1 * (i + 1) for i in range(len(expected))])
    sampled_prompt, params, seed = engine.calls[0]
    assert sampled_prompt == list(prompt) and seed == 11
    assert params.temperature == 0.7 and params.max_tokens == 5 and params.n == 1  # the run's, not the request's
    [recorded] = endpoint.turns("episode-1")
    assert recorded.prompt_ids == list(prompt) and recorded.completion_ids == expected


def test_generate_route_wire_format_stop_ids_and_sessions(served):
    _, endpoint, server = served
    root = server.base_url.removesuffix("/v1")
    body = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "stop_token_ids": [6]}}
    reply = requests.post(f"{root}/inference/v1/generate", json=body, headers={"X-Session-ID": "a"}, timeout=30)
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert reply.json()["prompt_token_ids"] == [1, 2, 3]
    assert choice["token_ids"] == [5, 6] and choice["finish_reason"] == "stop"  # cut after stop id 6
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["token_id:5", "token_id:6"]
    body["sampling_params"] = {"max_tokens": 2}
    again = requests.post(f"{root}/inference/v1/generate", json=body, headers={"X-Session-ID": "a"}, timeout=30)
    assert again.json()["choices"][0]["finish_reason"] == "length"
    assert [t.completion_ids for t in endpoint.turns("a")] == [[5, 6], [5, 6]]
    assert endpoint.turns("b") == []
    models = requests.get(f"{server.base_url}/models", timeout=30).json()
    assert models["data"][0]["id"] == "grpo-policy" and models["data"][0]["max_model_len"] == 1024
    endpoint.clear()
    assert endpoint.turns("a") == []


def test_chat_completions_route(served, tiny_tokenizer):
    _, endpoint, server = served
    messages = [{"role": "user", "content": "hi"}]
    reply = requests.post(f"{server.base_url}/chat/completions", json={"model": "m", "messages": messages},
                          headers={"X-Session-ID": "c"}, timeout=30).json()
    prompt = list(tiny_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False))
    assert reply["prompt_token_ids"] == prompt
    assert reply["choices"][0]["token_ids"] == [5, 6, 0, 7, 2]  # the EOS ends it
    assert reply["choices"][0]["message"]["content"] == tiny_tokenizer.decode([5, 6, 0, 7, 2],
                                                                               skip_special_tokens=True)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert endpoint.turns("c")[0].prompt_ids == prompt


@pytest.mark.parametrize("body", [{"model": "m"}, {"token_ids": "abc"}, {"token_ids": [1, True]}, [1, 2]])
def test_a_bad_request_is_a_400_that_names_the_problem(served, body):
    _, _, server = served
    reply = requests.post(f"{server.base_url.removesuffix('/v1')}/inference/v1/generate", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["message"]


def test_logprobs_come_from_logprobs_fn_when_the_engine_reports_none(tiny_tokenizer):
    seen = []

    def logprobs_fn(prompt_ids, completion_ids):
        seen.append((prompt_ids, completion_ids))
        return [-2.0] * len(completion_ids)

    endpoint = GenerateEndpoint(ScriptedEngine(own_logprobs=False), tiny_tokenizer, SamplingParams(max_tokens=2),
                                EOS, logprobs_fn, "m", 64)
    turn = endpoint.sample([1, 2], None, "s")
    assert turn.logprobs == [-2.0, -2.0] and seen == [([1, 2], [5, 6])] and not endpoint.engine_logprobs


def test_an_episodes_budget_counts_every_token_after_its_first_prompt(tiny_tokenizer):
    endpoint = GenerateEndpoint(ScriptedEngine(), tiny_tokenizer, SamplingParams(max_tokens=5), EOS, None, "m", 64)
    first = endpoint.sample([1, 2], None, "e")  # REPLY up to the EOS: 5 tokens, the whole budget
    assert first.completion_ids == [5, 6, 0, 7, 2]
    spent = endpoint.sample([1, 2, 5, 6, 0, 7, 2, 8], None, "e")
    assert spent.completion_ids == [] and not spent.finished
    other = endpoint.sample([1, 2, 3], 2, "f")  # another episode, its own budget, lowered by the request
    assert other.completion_ids == [5, 6]
    endpoint.sample([1, 2, 3], 2, "")  # requests without a session are each on their own
    assert endpoint.sample([1, 2, 3, 5, 6, 9, 9], 2, "").completion_ids == [5, 6]
