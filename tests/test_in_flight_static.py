"""In-flight weight updates for the hf-static engine (issue 45; ``decoupled.weight_update: in_flight`` or
``decoupled.partial_rollouts`` with ``rollout.engine: hf-static``): a newer version loaded into the policy between two
decode steps is copied into the sampling copy in place (the addresses a captured CUDA graph reads), so the tokens,
versions and log-probs are those of a plain reference loop that swaps the weights at the same token, full weights and
LoRA adapters alike. On a CPU the step runs eagerly; the CUDA graph's replay is checked with ``-m gpu``."""

from __future__ import annotations

import copy

import pytest
import torch
from in_flight_helpers import (SEED, TEMPERATURE, Publisher, lora_policy, published_adapter, reference_loop,
                               sampler_loads, set_adapter)
from step_helpers import CountSyncs

from grpo.config import load_config
from grpo.models.tiny import build_qwen2
from grpo.models.wrappers import eos_token_ids
from grpo.rollout.engine import SamplingParams
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.sampling_copy import SamplingCopy
from grpo.rollout.static import StaticEngine
from grpo.weight_store import apply_to_model

PROMPT, MAX_TOKENS = "12+34=", 14
SWAPS = [(4, 2), (3, 3), (5, 1)]  # (check_tokens, load_on): as tests/test_in_flight.py


def swap_checked(got, tokens: list[int], logprobs: list[float], swap_after: int) -> None:
    """``got``'s one row is the reference's ``tokens`` and ``logprobs``, version 0 before token ``swap_after``."""
    n = int(got.completion_mask.sum())
    assert n > swap_after, "the row ended before the swap: pick another prompt or seed"
    assert got.completion_ids[0, :n].tolist() == tokens
    assert got.token_versions[0, :n].tolist() == [0] * swap_after + [1] * (n - swap_after)
    assert torch.allclose(got.sampler_logprobs[0, :n], torch.tensor(logprobs), atol=1e-5)


@pytest.mark.parametrize("check_tokens, load_on", SWAPS)
def test_a_version_loaded_mid_sequence_gives_the_reference_loops_tokens(tiny_tokenizer, check_tokens, load_on):
    # The newer weights arrive in the policy at refresh call load_on (call 1: the prefill's), so they make every
    # token from (load_on - 1) * check_tokens on, through the sampling copy rewritten before the next step.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).eval()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    newer = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=1).state_dict()
    prompt = tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    swap_after = (load_on - 1) * check_tokens
    publisher = Publisher(lambda: model.load_state_dict(newer), load_on)
    engine = StaticEngine(model, tiny_tokenizer)
    params = SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    got = engine.generate_in_flight([prompt], params, SEED, InFlight(check_tokens, publisher.refresh))
    assert publisher.version == 1

    model.load_state_dict(initial)
    eos = eos_token_ids(model, tiny_tokenizer)
    if swap_after == 0:
        model.load_state_dict(newer)
    tokens, logprobs = reference_loop(model, prompt, lambda: model.load_state_dict(newer),
                                      swap_after if swap_after else -1, MAX_TOKENS, eos)
    swap_checked(got, tokens, logprobs, swap_after)
    # the reference without the swap draws other tokens: a copy left at version 0 would not match the one above
    model.load_state_dict(initial)
    unchanged, _ = reference_loop(model, prompt, lambda: None, -1, MAX_TOKENS, eos)
    assert unchanged != tokens


@pytest.mark.parametrize("check_tokens, load_on", SWAPS)
def test_an_adapter_loaded_mid_sequence_gives_the_reference_loops_tokens(tiny_tokenizer, tmp_path, check_tokens,
                                                                        load_on):
    # A LoRA policy: the sampler loads the published adapter into the peft layers, the copy merges it again.
    model = lora_policy(tiny_tokenizer)
    store = published_adapter(model, tmp_path, seed=1)
    prompt = tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    swap_after = (load_on - 1) * check_tokens
    engine = StaticEngine(model, tiny_tokenizer)
    publisher = Publisher(sampler_loads(model, engine, store), load_on)
    params = SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    got = engine.generate_in_flight([prompt], params, SEED, InFlight(check_tokens, publisher.refresh))
    assert publisher.version == 1

    def load_newer():
        apply_to_model(model, store.load(1))

    eos = eos_token_ids(model, tiny_tokenizer)
    set_adapter(model, 0)
    if swap_after == 0:
        load_newer()
    tokens, logprobs = reference_loop(model, prompt, load_newer, swap_after if swap_after else -1, MAX_TOKENS, eos)
    swap_checked(got, tokens, logprobs, swap_after)
    set_adapter(model, 0)
    unchanged, _ = reference_loop(model, prompt, lambda: None, -1, MAX_TOKENS, eos)
    assert unchanged != tokens


def test_the_copy_is_rewritten_in_place_at_the_prefill_and_on_a_new_version_only(tiny_tokenizer, monkeypatch):
    # Fails if a loaded version does not reach the sampling copy, or reaches it through new tensors (the captured
    # graph would go on reading the old ones), or if the copy is rewritten at every check (its whole cost per check).
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
    newer = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=1).state_dict()
    engine = StaticEngine(model, tiny_tokenizer)
    addresses = [p.data_ptr() for p in engine.copy.model.parameters()]
    refreshes, refresh = [], SamplingCopy.refresh
    monkeypatch.setattr(SamplingCopy, "refresh", lambda self: refreshes.append(publisher.calls) or refresh(self))
    publisher = Publisher(lambda: model.load_state_dict(newer), load_on=3)
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("1+1=", "22*3=")]
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, min_new_tokens=10)
    got = engine.generate_in_flight(prompts, params, SEED, InFlight(2, publisher.refresh))
    assert publisher.calls == 1 + 9 // 2  # the prefill's, then after tokens 1, 3, 5, 7
    assert refreshes == [1, 3]  # at the prefill's check, then at the check that loaded version 1
    assert [p.data_ptr() for p in engine.copy.model.parameters()] == addresses
    copied = dict(engine.copy.model.named_parameters())
    assert all(torch.equal(copied[name], value) for name, value in newer.items() if name in copied)
    want = (torch.arange(10) >= 4).long().expand(6, 10)  # the check after token 3 loaded it
    assert torch.equal(got.token_versions, want) and bool((got.sampler_logprobs < 0).all())


def test_without_updates_the_in_flight_engine_draws_the_plain_engines_tokens(tiny_tokenizer):
    # What partial rollouts without in-flight updates use: the records' version stays the chunk's.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
    prompts = ["1+1=", "9-4="]
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, top_k=20)
    plain = StaticEngine(model, tiny_tokenizer).generate(prompts, params, seed=SEED)
    live = in_flight_engine(StaticEngine(model, tiny_tokenizer), InFlight(3, lambda: 7), tiny_tokenizer, "hf-static")
    got = live.generate(prompts, params, seed=SEED)
    assert torch.equal(got.completion_ids, plain.completion_ids) and plain.token_versions is None
    assert torch.equal(got.token_versions, 7 * got.completion_mask)


def test_the_config_takes_in_flight_and_partial_rollouts_with_hf_static():
    decoupled = ["train.mode=decoupled", "rollout.engine=hf-static"]
    cfg = load_config(None, [*decoupled, "decoupled.weight_update=in_flight", "model.lora_r=8"])
    assert (cfg.rollout.engine, cfg.decoupled.weight_update) == ("hf-static", "in_flight")
    cfg = load_config(None, [*decoupled, "decoupled.partial_rollouts=true", "train.max_staleness=1",
                             "rollout.max_completion_length=64"])
    assert cfg.decoupled.partial_rollouts


def every_check_loads(model):
    """A ``refresh`` that loads a new version at every call: the policy's weights scaled in place."""
    state = {"version": 0}

    @torch.no_grad()
    def refresh() -> int:
        state["version"] += 1
        for param in model.parameters():
            param.mul_(0.999)
        return state["version"]

    return refresh


def test_recording_and_loading_add_no_host_sync_per_token(tiny_tokenizer):
    # What a CUDA graph needs of the step (tests/test_static_engine.py), with the record written by the step and a
    # new version copied in at every second token: the would-be syncs of a call do not grow with its tokens.
    def syncs(max_tokens):
        model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
        engine = StaticEngine(model, tiny_tokenizer, eos_check_every=1000)
        params = SamplingParams(n=2, max_tokens=max_tokens, temperature=1.0, min_new_tokens=max_tokens)
        counter = CountSyncs()
        with counter:
            got = engine.generate_in_flight([[5, 6, 7]], params, SEED, InFlight(2, every_check_loads(model)))
        assert int(got.token_versions[0, -1]) == 1 + (max_tokens - 1) // 2
        return sum(counter.by_file.values())

    assert syncs(6) == syncs(30)


@pytest.mark.slow
def test_the_compiled_step_records_what_the_eager_one_does(tiny_tokenizer):
    # torch.compile(fullgraph=True) fails on a graph break: the recording step stays capturable. ~30 s on 2 cores.
    def run(decode_graph: str):
        model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0).eval()
        engine = StaticEngine(model, tiny_tokenizer, decode_graph=decode_graph)
        params = SamplingParams(n=2, max_tokens=10, temperature=0.8, top_k=20)
        return engine.generate_in_flight([[5, 6, 7], [8, 9]], params, SEED, InFlight(3, every_check_loads(model)))

    eager, compiled = run("eager"), run("compile")
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    assert torch.equal(eager.token_versions, compiled.token_versions)
    assert torch.allclose(eager.sampler_logprobs, compiled.sampler_logprobs, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_the_cuda_graph_reads_the_weights_loaded_in_flight(tiny_tokenizer):
    # The replayed graph must draw what the eager step draws when the weights change mid-call (fp32 copies: the
    # same arithmetic), with the same versions and log-probs.
    base = build_qwen2(tiny_tokenizer, seed=3).eval().cuda()
    newer = build_qwen2(tiny_tokenizer, seed=4).state_dict()
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("1+1=", "22*3=")]
    params = SamplingParams(n=4, max_tokens=40, temperature=1.0, top_p=0.95)

    def run(decode_graph: str):
        model = copy.deepcopy(base)
        engine = StaticEngine(model, tiny_tokenizer, dtype=torch.float32, decode_graph=decode_graph)
        publisher = Publisher(lambda: model.load_state_dict(newer), load_on=3)
        got = engine.generate_in_flight(prompts, params, SEED, InFlight(4, publisher.refresh))
        return engine, got

    graph_engine, graph = run("cuda-graph")
    _, eager = run("eager")
    assert graph_engine.graph_failure is None
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    assert torch.equal(graph.token_versions, eager.token_versions) and int(graph.token_versions.max()) == 1
    assert torch.allclose(graph.sampler_logprobs, eager.sampler_logprobs, atol=1e-4)
