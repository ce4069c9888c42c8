"""The reference server: a FastAPI app computing reference log-probs, and the uvicorn server around it."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import threading

import torch
import uvicorn
from fastapi import (  # at module level: FastAPI resolves `request: Request` in module globals
    FastAPI,
    Request,
)
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from torch import Tensor
from transformers import AutoModelForCausalLM

from grpo.config import ConfigError
from grpo.decoupled.ref_server.protocol import (
    CONTENT_TYPE,
    PROTOCOL,
    PROTOCOL_HEADER,
    RefProtocolError,
    RefRequest,
    decode_request,
    encode_response,
)
from grpo.decoupled.listen import hidden_loopback
from grpo.models.loading import DTYPES, resolve_device
from grpo.step.logprob_pass import DEVICE_DEFAULT_PASS, LogprobPass
from grpo.step.logprobs import completion_logprobs

logger = logging.getLogger("grpo.decoupled.ref_server")  # the package's name: its modules log as one


def build_app(
    model: torch.nn.Module,
    *,
    temperature: float,
    token: str | None,
    max_request_bytes: int,
    micro_batch_size: int | None,
    model_name: str | None = None,
    logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS,
):
    """A FastAPI app serving ``model``'s log-probs (see ``grpo.decoupled.ref_server`` for the protocol).

    Args:
        model: a causal LM; put in eval mode with gradients off (the server owns it).
        temperature: the sampling temperature the log-probs are computed at (> 0).
        token: when set, every request needs ``Authorization: Bearer <token>``.
        max_request_bytes: larger bodies get 413 without being parsed.
        micro_batch_size: rows per forward pass; None = a request's rows all at once.
        model_name: reported by /v1/health; default ``model.name_or_path``.
        logprob_pass: how the log-prob passes run (``grpo.training.settings.logprob_pass``: the run's
            train.shared_prompt_pass and train.column_bucket); default: the device type's choices.
    """
    _check_app_arguments(temperature, max_request_bytes, micro_batch_size)
    model.eval()
    model.requires_grad_(False)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    name = model_name or str(getattr(model, "name_or_path", "") or type(model).__name__)
    expected_auth = None if token is None else f"Bearer {token}".encode()
    forward_lock = threading.Lock()  # one forward at a time: the device holds one batch's activations
    app = FastAPI(title="grpo reference log-probs", docs_url=None, redoc_url=None, openapi_url=None)

    def compute(req: RefRequest) -> Tensor:
        with forward_lock, torch.no_grad():
            return completion_logprobs(model, req.prompt_ids, req.prompt_mask, req.completion_ids,
                                       req.completion_mask, temperature, micro_batch_size,
                                       share_prompts=logprob_pass.share_prompts,
                                       column_bucket=logprob_pass.column_bucket,
                                       fused_head=logprob_pass.fused_head, pack=logprob_pass.pack)  # [N, Lc]

    @app.get("/v1/health")
    def health(request: Request):
        if not authorised(request, expected_auth):
            return error_response(401, "missing or wrong bearer token")
        return {"protocol": PROTOCOL, "model": name, "temperature": temperature, "vocab_size": vocab_size,
                "max_request_bytes": max_request_bytes}

    @app.post("/v1/logprobs")
    async def logprobs(request: Request):
        if not authorised(request, expected_auth):
            return error_response(401, "missing or wrong bearer token")
        req = await read_ref_request(request, max_request_bytes=max_request_bytes, vocab_size=vocab_size,
                                     temperature=temperature)
        if isinstance(req, JSONResponse):
            return req
        try:
            ref_logprobs = await run_in_threadpool(compute, req)  # the event loop keeps answering /health
        except Exception as err:  # any forward failure (OOM, ...) becomes a 500, logged; the server lives on
            logger.exception("ref server: forward pass failed for a [%d, %d] request",
                             req.completion_ids.shape[0], req.prompt_ids.shape[1] + req.completion_ids.shape[1])
            return error_response(500, f"forward pass failed: {type(err).__name__}: {str(err)[:200]}")
        return Response(encode_response(ref_logprobs), media_type=CONTENT_TYPE,
                        headers={PROTOCOL_HEADER: str(PROTOCOL)})

    return app


def _check_app_arguments(temperature: float, max_request_bytes: int, micro_batch_size: int | None) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")


def error_response(status: int, message: str) -> JSONResponse:
    """The JSON error body every refusal carries (with the protocol, so a client sees what the server speaks)."""
    return JSONResponse({"error": message, "protocol": PROTOCOL}, status_code=status,
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def authorised(request: Request, expected_auth: bytes | None) -> bool:
    """Whether ``request`` carries the expected ``Authorization`` header (None: none is needed); a refusal is
    logged with the client's address."""
    if expected_auth is None:
        return True
    # Starlette decodes headers as latin-1; encoding back gives the bytes that were sent.
    given = request.headers.get("authorization", "").encode("latin-1")
    if hmac.compare_digest(given, expected_auth):
        return True
    client = request.client.host if request.client else "?"
    logger.warning("ref server: refused %s %s from %s: %s bearer token", request.method, request.url.path,
                   client, "wrong" if given else "missing")
    return False


async def read_ref_request(request: Request, *, max_request_bytes: int, vocab_size: int,
                           temperature: float) -> RefRequest | JSONResponse:
    """The ``/v1/logprobs`` request decoded, or the error response that refuses it: protocol header, content
    type, body size (declared and as it arrives), the body itself, and the client's temperature."""
    version = request.headers.get(PROTOCOL_HEADER)
    if version is None:
        return error_response(400, f"missing header {PROTOCOL_HEADER} (this server speaks protocol {PROTOCOL})")
    if version.strip() != str(PROTOCOL):
        return error_response(426, f"{PROTOCOL_HEADER}: {version[:20]!r} is not supported; this server speaks "
                                   f"{PROTOCOL}")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != CONTENT_TYPE:
        return error_response(415, f"Content-Type must be {CONTENT_TYPE}, got {content_type!r}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            return error_response(400, f"Content-Length {declared[:20]!r} is not a number")
        if int(declared) > max_request_bytes:
            return error_response(413, f"body of {declared} bytes exceeds the limit of {max_request_bytes}")
    body = bytearray()
    async for chunk in request.stream():  # counted as it arrives: chunked bodies have no Content-Length
        body += chunk
        if len(body) > max_request_bytes:
            return error_response(413, f"body exceeds the limit of {max_request_bytes} bytes")
    try:
        req = decode_request(bytes(body), vocab_size)
    except RefProtocolError as err:
        return error_response(err.status, str(err))
    if req.temperature is not None and req.temperature != temperature:
        return error_response(400, f"the client expects temperature {req.temperature}, but this server computes "
                                   f"log-probs at {temperature}")
    return req


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_server(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    temperature: float = 1.0,
    token_env: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    max_request_mb: float = 64.0,
    micro_batch_size: int | None = None,
    logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS,
):
    """Load the reference model and return a ``uvicorn.Server`` for it (not yet running).

    Args:
        model_path: a HF checkpoint folder or hub id (AutoModelForCausalLM).
        host, port: where to listen. A host other than loopback needs a token.
        token_env: the name of an environment variable holding the bearer token (the token itself is
            never a command-line argument, where ``ps`` would show it); None = no authentication.
        device: "auto", "cpu", "cuda", "cuda:1", ...
        dtype: float32, bfloat16, float16; None = as stored in the checkpoint.
        max_request_mb: request bodies above this many MiB get 413.
        micro_batch_size, logprob_pass: as ``build_app``.
    Raises ConfigError (before loading anything) for a non-loopback host without a token, an unset
    token variable, an unknown dtype or a non-positive temperature.
    """
    token = None
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise ConfigError(f"token_env: the environment variable {token_env!r} is unset or empty")
    if not is_loopback(host) and token is None:
        raise ConfigError(f"host: refusing to serve on {host!r} without authentication; bind 127.0.0.1 or set a "
                          "token with token_env (anyone who can reach the port could use the model otherwise)")

    try:
        hidden = hidden_loopback(host)
    except ValueError as err:
        raise ConfigError(f"host: {err}") from None
    if hidden:
        raise ConfigError(f"host: {host!r} resolves only to loopback ({', '.join(hidden)}), so samplers on other "
                          "machines could never connect; bind the machine's network address, or 0.0.0.0 for all")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)} (or null = as stored)")
    if temperature <= 0:
        raise ConfigError(f"temperature: must be > 0, got {temperature}")
    if max_request_mb <= 0:
        raise ConfigError(f"max_request_mb: must be > 0, got {max_request_mb}")
    check_port_free(host, port)  # before the model loads, not after (uvicorn then exits 3 with a log line)

    kwargs = {"dtype": DTYPES[dtype]} if dtype is not None else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(resolve_device(device)).eval()
    app = build_app(model, temperature=temperature, token=token, max_request_bytes=int(max_request_mb * 2**20),
                    micro_batch_size=micro_batch_size, model_name=model_path, logprob_pass=logprob_pass)
    shown_host = f"[{host}]" if ":" in host else host
    logger.info("ref server: %s at temperature %g on %s, listening on http://%s:%d (auth: %s)", model_path,
                temperature, next(model.parameters()).device, shown_host, port, "bearer token" if token else "none")
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))


def check_port_free(host: str, port: int) -> None:
    """ConfigError naming the port when ``host:port`` cannot be bound (another process listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as err:
            raise ConfigError(f"port: cannot listen on {host}:{port} ({err.strerror}); is another reference "
                              "server running? Stop it or choose another decoupled.ref_server_port") from None


def run_ref_server(model_path: str, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serve reference log-probs until interrupted (``options``: the rest of ``make_server``'s arguments)."""
    server = make_server(model_path, host, port, **options)
    print(f"grpo ref server: http://{f'[{host}]' if ':' in host else host}:{port}/v1", flush=True)
    try:
        server.run()
    except SystemExit as exit:  # uvicorn's own startup failure (status 3): the port was taken meanwhile
        if exit.code:
            raise ConfigError(f"port: the server could not start on {host}:{port} (uvicorn's error is above)") from None
        raise
