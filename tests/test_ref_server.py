"""grpo.decoupled.ref_server: log-probs over HTTP equal the local ones; auth, protocol and size checks; a fuzzed decoder."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import requests
import safetensors.torch
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from grpo.config import ConfigError
from grpo.decoupled.ref_server import (
    CONTENT_TYPE,
    PROTOCOL_HEADER,
    RefProtocolError,
    RefServerClient,
    RefServerError,
    build_app,
    decode_request,
    encode_request,
    is_loopback,
    make_server,
)
from grpo.models.tiny import build_qwen2
from grpo.step.logprobs import completion_logprobs

TEMPERATURE = 0.7
TOKEN = "s3cret-token"
MAX_BYTES = 16 * 1024
VOCAB = 431  # the tiny tokenizer's size, checked in test_health_and_logprobs_match_local_computation


@contextmanager
def serve(app):
    """Run ``app`` with uvicorn in a daemon thread on a free 127.0.0.1 port; yield its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the port is held from here on: no race with another process
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_qwen2(tiny_tokenizer, seed=0).eval()


@pytest.fixture(scope="module")
def open_url(model):
    with serve(build_app(model, temperature=TEMPERATURE, token=None, max_request_bytes=MAX_BYTES,
                         micro_batch_size=2, model_name="tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def auth_url(model):
    with serve(build_app(model, temperature=TEMPERATURE, token=TOKEN, max_request_bytes=MAX_BYTES,
                         micro_batch_size=2, model_name="tiny")) as url:
        yield url


def make_batch(n=3, lp=5, lc=4, vocab=VOCAB, seed=0):
    """Left-padded prompts and right-padded completions with random ids (pad positions hold id 0)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (n, lp), generator=gen)
    completion_ids = torch.randint(0, vocab, (n, lc), generator=gen)
    prompt_mask = torch.ones(n, lp, dtype=torch.long)
    completion_mask = torch.ones(n, lc, dtype=torch.long)
    for row in range(n):
        prompt_mask[row, :row] = 0  # row r has r pad tokens on the left
        completion_mask[row, lc - row:] = 0  # and r on the right of its completion
    return prompt_ids * prompt_mask, prompt_mask, completion_ids * completion_mask, completion_mask


def post(url, body, **headers):
    headers = {PROTOCOL_HEADER: "1", "Content-Type": CONTENT_TYPE, **headers}
    return requests.post(f"{url}/v1/logprobs", data=body, headers=headers, timeout=10)


# ---------------------------------------------------------------- over HTTP


def test_health_and_logprobs_match_local_computation(open_url, model, tiny_tokenizer):
    assert len(tiny_tokenizer) == VOCAB
    client = RefServerClient(open_url, timeout_s=10)
    info = client.wait_ready(timeout_s=10)
    assert info == {"protocol": 1, "model": "tiny", "temperature": TEMPERATURE, "vocab_size": VOCAB,
                    "max_request_bytes": MAX_BYTES}
    batch = make_batch()
    remote = client.logprobs(*batch)
    with torch.no_grad():
        local = completion_logprobs(model, *batch, temperature=TEMPERATURE, micro_batch_size=2)
    assert remote.dtype == torch.float32 and remote.shape == (3, 4)
    torch.testing.assert_close(remote, local, rtol=0, atol=1e-6)
    # A client that states the temperature gets the same answer; another temperature is refused.
    torch.testing.assert_close(RefServerClient(open_url, temperature=TEMPERATURE).logprobs(*batch), local,
                               rtol=0, atol=1e-6)
    with pytest.raises(RefServerError, match="status 400.*temperature 1.0"):
        RefServerClient(open_url, temperature=1.0).logprobs(*batch)


def test_token_is_required_and_the_server_keeps_serving(auth_url, caplog):
    batch = make_batch()
    body = encode_request(*batch)
    with caplog.at_level(logging.WARNING, logger="grpo.decoupled.ref_server"):
        missing = post(auth_url, body)
        wrong = post(auth_url, body, Authorization="Bearer not-the-token")
    assert missing.status_code == 401 and "bearer token" in missing.json()["error"]
    assert wrong.status_code == 401
    assert requests.get(f"{auth_url}/v1/health", timeout=10).status_code == 401
    assert sum("refused POST /v1/logprobs" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(RefServerError, match="status 401") as err:
        RefServerClient(auth_url, token="wrong").wait_ready(timeout_s=30)  # at once: waiting cannot fix it
    assert err.value.status == 401
    client = RefServerClient(auth_url, token=TOKEN)
    assert client.wait_ready(timeout_s=10)["protocol"] == 1
    assert client.logprobs(*batch).shape == (3, 4)


def test_protocol_header_and_content_type_are_checked(open_url):
    body = encode_request(*make_batch())
    missing = requests.post(f"{open_url}/v1/logprobs", data=body, headers={"Content-Type": CONTENT_TYPE}, timeout=10)
    assert missing.status_code == 400 and PROTOCOL_HEADER in missing.json()["error"]
    other = post(open_url, body, **{PROTOCOL_HEADER: "2"})
    assert other.status_code == 426 and other.json()["protocol"] == 1
    assert post(open_url, body, **{"Content-Type": "application/json"}).status_code == 415
    ok = post(open_url, body)
    assert ok.status_code == 200 and ok.headers[PROTOCOL_HEADER] == "1"


def test_oversized_bodies_get_413(open_url):
    too_big = b"\0" * (MAX_BYTES + 1)
    declared = post(open_url, too_big)
    assert declared.status_code == 413 and str(MAX_BYTES) in declared.json()["error"]
    # Chunked transfer has no Content-Length: the server counts the bytes as they arrive.
    chunked = post(open_url, iter([b"\0" * 4096] * 5))
    assert chunked.status_code == 413
    # A client that has seen /v1/health refuses before sending.
    client = RefServerClient(open_url)
    client.health()
    with pytest.raises(RefServerError, match="exceeds the server's limit"):
        client.logprobs(*make_batch(n=8, lp=64, lc=64))


@pytest.mark.parametrize("case", ["garbage", "wrong_keys", "wrong_dtype", "shapes", "token_range", "mask_values"])
def test_malformed_requests_get_400(open_url, case):
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch()
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
               "completion_ids": completion_ids, "completion_mask": completion_mask}
    if case == "garbage":
        body = b"this is not safetensors at all"
    else:
        if case == "wrong_keys":
            tensors["extra"] = tensors.pop("prompt_mask")
        elif case == "wrong_dtype":
            tensors["prompt_ids"] = prompt_ids.float()
        elif case == "shapes":
            tensors["completion_mask"] = completion_mask[:, :2].contiguous()
        elif case == "token_range":
            tensors["completion_ids"] = completion_ids.clone()
            tensors["completion_ids"][1, 0] = VOCAB  # one past the last embedding row
        elif case == "mask_values":
            tensors["prompt_mask"] = prompt_mask * 2
        body = safetensors.torch.save(tensors)
    response = post(open_url, body)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error", "protocol"}
    if case == "token_range":
        assert f"token ids must be in [0, {VOCAB})" in response.json()["error"]


class ExplodingModel(torch.nn.Module):
    """Has an embedding (for the vocabulary size) but every forward pass fails, like an OOM would."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 4)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")


def test_forward_failure_is_a_500_and_the_client_retries(caplog):
    app = build_app(ExplodingModel(), temperature=1.0, token=None, max_request_bytes=MAX_BYTES, micro_batch_size=None)
    with serve(app) as url:
        client = RefServerClient(url, retries=2, backoff_s=0.01)
        with caplog.at_level(logging.WARNING), pytest.raises(RefServerError, match="status 500.*out of memory") as err:
            client.logprobs(*make_batch())
        assert err.value.status == 500
        assert sum("retrying" in r.getMessage() for r in caplog.records) == 2  # 3 attempts in all
        assert client.health()["vocab_size"] == VOCAB  # still serving


def test_client_connection_errors():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        client = RefServerClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01, timeout_s=2)
        with pytest.raises(RefServerError, match="cannot connect after 2 attempts"):
            client.logprobs(*make_batch())
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not ready within 0.3 s"):
            client.wait_ready(timeout_s=0.3, poll_s=0.05)
        assert time.monotonic() - start < 5


def test_make_server_loads_a_checkpoint_and_serves_it(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("GRPO_TEST_REF_TOKEN", TOKEN)
    server = make_server(str(tiny_model_dir), port=0, temperature=TEMPERATURE, token_env="GRPO_TEST_REF_TOKEN",
                         device="cpu", dtype="float32", max_request_mb=1, micro_batch_size=None)
    with serve(server.config.app) as url:
        client = RefServerClient(url, token=TOKEN)
        assert client.wait_ready(timeout_s=10)["max_request_bytes"] == 2**20
        batch = make_batch()
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            local = completion_logprobs(reference, *batch, temperature=TEMPERATURE)
        torch.testing.assert_close(client.logprobs(*batch), local, rtol=0, atol=1e-6)


def test_the_server_runs_its_passes_as_the_run_configures_them(tiny_model_dir, monkeypatch):
    """train.shared_prompt_pass / train.column_bucket (``grpo.training.settings.logprob_pass``) reach the
    server's log-prob passes; the values stay the plain pass's."""
    from transformers import AutoModelForCausalLM

    import grpo.decoupled.ref_server.app
    from grpo.step.logprob_pass import LogprobPass

    passes = []
    real = grpo.decoupled.ref_server.app.completion_logprobs
    monkeypatch.setattr(grpo.decoupled.ref_server.app, "completion_logprobs",
                        lambda *a, **kw: passes.append((kw["share_prompts"], kw["column_bucket"])) or real(*a, **kw))
    server = make_server(str(tiny_model_dir), port=0, temperature=TEMPERATURE, device="cpu", dtype="float32",
                         logprob_pass=LogprobPass(share_prompts=False, column_bucket=8))
    with serve(server.config.app) as url:
        batch = make_batch()
        remote = RefServerClient(url).logprobs(*batch)
    assert passes == [(False, 8)]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        local = real(reference, *batch, temperature=TEMPERATURE, share_prompts=False)
    torch.testing.assert_close(remote, local, rtol=0, atol=1e-6)


def test_non_loopback_bind_needs_a_token(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("GRPO_TEST_UNSET_TOKEN", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.7", "example.com"):
        with pytest.raises(ConfigError, match="without authentication"):
            make_server(str(tiny_model_dir), host=host, port=0)
    with pytest.raises(ConfigError, match="GRPO_TEST_UNSET_TOKEN"):
        make_server(str(tiny_model_dir), host="0.0.0.0", port=0, token_env="GRPO_TEST_UNSET_TOKEN")
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "localhost.example.com"))


# ---------------------------------------------------------------- the decoder, without HTTP


def test_decoder_round_trip_and_bool_masks():
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch(n=2, lp=3, lc=5)
    decoded = decode_request(encode_request(prompt_ids, prompt_mask, completion_ids, completion_mask, 0.5), VOCAB)
    assert decoded.temperature == 0.5
    for got, want in zip((decoded.prompt_ids, decoded.prompt_mask, decoded.completion_ids, decoded.completion_mask),
                         (prompt_ids, prompt_mask, completion_ids, completion_mask)):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    body = safetensors.torch.save({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.bool(),
                                   "completion_ids": completion_ids, "completion_mask": completion_mask.bool()})
    decoded = decode_request(body, VOCAB)
    assert decoded.temperature is None and decoded.prompt_mask.dtype == torch.int64
    assert torch.equal(decoded.completion_mask, completion_mask)
    with pytest.raises(RefProtocolError, match="non-empty 2-D"):
        encode_request(prompt_ids[:, :0], prompt_mask[:, :0], completion_ids, completion_mask)


VALID_BODY = encode_request(*make_batch(n=2, lp=3, lc=2), temperature=0.7)


def assert_only_protocol_errors(body: bytes) -> None:
    try:
        decode_request(body, VOCAB)
    except RefProtocolError as err:
        assert err.status == 400
    # Any other exception propagates and fails the test.


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_decoder_fuzz_arbitrary_bytes(body):
    assert_only_protocol_errors(body)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID_BODY) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID_BODY)))
def test_decoder_fuzz_mutated_valid_bodies(edits, cut):
    body = bytearray(VALID_BODY)
    for position, value in edits:
        body[position] = value
    assert_only_protocol_errors(bytes(body[:cut]) if cut else bytes(body))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["I64", "BOOL", "F32", "I32", "U8", "F8_E5M2", "X"]) | json_values,
    "shape": st.lists(st.integers(-2, 2**40) | json_values, max_size=3),
    "data_offsets": st.lists(st.integers(-2, 2**64) | json_values, max_size=3),
})
names = st.sampled_from(["prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "__metadata__", "x"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, entry | json_values, max_size=6), st.binary(max_size=256))
@example({"prompt_ids": {"dtype": [], "shape": [], "data_offsets": []}, "prompt_mask": None,
          "completion_ids": None, "completion_mask": None}, b"")  # found by this test: an unhashable dtype
def test_decoder_fuzz_structured_headers(header, data):
    """Headers that look like safetensors (the right names, plausible dtypes/shapes/offsets) over random data."""
    text = json.dumps(header).encode()
    assert_only_protocol_errors(len(text).to_bytes(8, "little") + text + data)


def test_a_busy_port_is_a_configuration_error_before_the_model_loads(tmp_path, capsys):
    # uvicorn alone found out only after the model loaded, and exited 3, a status the command line never names.
    import socket

    from grpo.cli import main
    from grpo.errors import EXIT_BAD_INPUT

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["ref-server", f"decoupled.ref_server_port={port}",
                     f"model.name_or_path={tmp_path / 'no-model-here'}"])  # never loaded: the port comes first
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "decoupled.ref_server_port" in err, err
