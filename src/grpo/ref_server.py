"""Reference log-probs over HTTP, so that a large teacher reference model can sit on its own device.

Protocol, version 1 (``PROTOCOL``)::

    POST /v1/logprobs
        headers: Content-Type: application/octet-stream, X-GRPO-Protocol: 1,
                 Authorization: Bearer <token>   (when the server has a token)
        body:    safetensors bytes of exactly
                   prompt_ids      int64       [N, Lp]  left-padded prompts
                   prompt_mask     int64|bool  [N, Lp]  1 for real prompt tokens
                   completion_ids  int64       [N, Lc]  right-padded completions
                   completion_mask int64|bool  [N, Lc]  1 for completion tokens
                 and optionally the safetensors metadata {"temperature": repr(float)}: the temperature the
                 client expects; the server refuses a request whose temperature is not its own.
        200:     safetensors bytes of {ref_logprobs: float32 [N, Lc]} (padding positions hold finite
                 values that the loss masks out), header X-GRPO-Protocol: 1
    GET /v1/health -> {"protocol": 1, "model": name, "temperature": t, "vocab_size": V, "max_request_bytes": B}

Errors are JSON ``{"error": message, "protocol": 1}``: 400 malformed request (not safetensors, wrong
keys, dtypes or shapes, token ids outside [0, V), mask values other than 0/1, a temperature mismatch),
401 missing or wrong bearer token, 413 body over the size limit (checked on Content-Length and on
the bytes actually received, before parsing), 415 wrong content type, 426 another protocol version
(400 when the header is missing), 500 the forward pass failed.

Only safetensors and JSON cross the wire: nothing is unpickled. Log-probs are computed with
``grpo.logprobs.completion_logprobs`` in eval mode under ``torch.no_grad``, one request at a time.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import requests
import safetensors.torch
import torch
from fastapi import FastAPI, Request  # at module level: FastAPI resolves `request: Request` in module globals
from fastapi.responses import JSONResponse, Response
from safetensors import SafetensorError
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from grpo.config import ConfigError
from grpo.logprobs import completion_logprobs

logger = logging.getLogger(__name__)

PROTOCOL = 1
PROTOCOL_HEADER = "X-GRPO-Protocol"
CONTENT_TYPE = "application/octet-stream"
REQUEST_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
RESPONSE_KEY = "ref_logprobs"
_ID_DTYPES = {"I64"}
_MASK_DTYPES = {"I64", "BOOL"}
_ITEM_BYTES = {"I64": 8, "BOOL": 1}
_MAX_HEADER_BYTES = 64 * 1024  # four tensor entries need a few hundred bytes
BODY_EXCERPT_CHARS = 300


class RefProtocolError(ValueError):
    """A request (or response) that does not follow the protocol; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RefServerError(RuntimeError):
    """The reference server could not give a valid answer (the message has the status and a body excerpt);
    ``status`` is the HTTP status, or None when there was no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RefRequest:
    """A decoded, validated ``/v1/logprobs`` request.

    prompt_ids, prompt_mask:         [N, Lp] int64, left-padded.
    completion_ids, completion_mask: [N, Lc] int64, right-padded.
    temperature: the temperature the client expects, or None when it did not say.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    temperature: float | None


# ---------------------------------------------------------------- wire format


def encode_request(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                   temperature: float | None = None) -> bytes:
    """The request body: the four tensors as int64 CPU safetensors (+ the expected temperature)."""
    tensors = {name: t.detach().to("cpu", torch.int64).contiguous()
               for name, t in zip(REQUEST_KEYS, (prompt_ids, prompt_mask, completion_ids, completion_mask))}
    _check_shapes({name: tuple(t.shape) for name, t in tensors.items()})
    metadata = None if temperature is None else {"temperature": repr(float(temperature))}
    return safetensors.torch.save(tensors, metadata=metadata)


def decode_request(body: bytes, vocab_size: int) -> RefRequest:
    """Parse and validate a request body; any problem raises ``RefProtocolError`` (status 400).

    The safetensors header is checked first (keys, dtypes, shapes) so that the tensors are only
    materialised for a well-formed request; memory is bounded by ``len(body)``.
    """
    header = _read_header(body)
    metadata = header.pop("__metadata__", None)
    if set(header) != set(REQUEST_KEYS):
        raise RefProtocolError(f"the body must hold exactly the tensors {list(REQUEST_KEYS)}, "
                               f"got {_short(sorted(header))}")
    shapes = {}
    for name in REQUEST_KEYS:
        entry = header[name]
        allowed = _ID_DTYPES if name.endswith("_ids") else _MASK_DTYPES
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or dtype not in allowed:  # a list would not even hash
            raise RefProtocolError(f"{name}: dtype {_short(dtype)} not allowed (expected {sorted(allowed)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise RefProtocolError(f"{name}: shape {_short(shape)} is not a list of ints")
        shapes[name] = tuple(shape)
    _check_shapes(shapes)
    described = sum(_ITEM_BYTES[header[name]["dtype"]] * shapes[name][0] * shapes[name][1] for name in REQUEST_KEYS)
    if described > len(body):  # checked before the parser allocates anything from these numbers
        raise RefProtocolError(f"the body is not safetensors (its header describes {described} bytes of tensors, "
                               f"the body has {len(body)})")
    temperature = _temperature_from(metadata)
    try:
        tensors = safetensors.torch.load(body)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:  # offsets, sizes, buffer errors
        raise RefProtocolError(f"the body is not valid safetensors: {err}") from err
    for name in REQUEST_KEYS:
        tensor = tensors[name]
        if tuple(tensor.shape) != shapes[name]:  # the parser agrees with the header checked above
            raise RefProtocolError(f"{name}: shape {tuple(tensor.shape)} disagrees with its header {shapes[name]}")
        if name.endswith("_mask") and tensor.dtype != torch.bool and not bool(((tensor == 0) | (tensor == 1)).all()):
            raise RefProtocolError(f"{name}: values must be 0 or 1")
    for name in ("prompt_ids", "completion_ids"):
        ids = tensors[name]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise RefProtocolError(f"{name}: token ids must be in [0, {vocab_size}), got min {low}, max {high}")
    return RefRequest(
        prompt_ids=tensors["prompt_ids"], prompt_mask=tensors["prompt_mask"].to(torch.int64),
        completion_ids=tensors["completion_ids"], completion_mask=tensors["completion_mask"].to(torch.int64),
        temperature=temperature,
    )


def _read_header(body: bytes) -> dict[str, Any]:
    """The safetensors JSON header: an 8-byte little-endian length, then that many bytes of JSON."""
    if not isinstance(body, (bytes, bytearray)) or len(body) < 8:
        raise RefProtocolError("the body is not safetensors (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", body[:8])
    if length > min(_MAX_HEADER_BYTES, len(body) - 8):
        raise RefProtocolError(f"the body is not safetensors (header length {length} for a {len(body)}-byte body)")
    try:
        header = json.loads(bytes(body[8:8 + length]).decode("utf-8"))
    except (ValueError, RecursionError) as err:  # bad UTF-8 / JSON, or JSON nested too deep
        raise RefProtocolError(f"the body is not safetensors (header is not JSON: {str(err)[:100]})") from err
    if not isinstance(header, dict):
        raise RefProtocolError("the body is not safetensors (header is not a JSON object)")
    return header


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: error messages quote client input, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_shapes(shapes: dict[str, tuple]) -> None:
    """[N, Lp] prompts and [N, Lc] completions, N, Lp, Lc >= 1 (the first completion token needs a prompt)."""
    for name, shape in shapes.items():
        if len(shape) != 2 or min(shape) < 1:
            raise RefProtocolError(f"{name}: expected a non-empty 2-D [N, L] tensor, got shape {list(shape)}")
    prompt, completion = shapes["prompt_ids"], shapes["completion_ids"]
    if shapes["prompt_mask"] != prompt or shapes["completion_mask"] != completion or prompt[0] != completion[0]:
        raise RefProtocolError("inconsistent shapes: need prompt_ids/prompt_mask [N, Lp] and completion_ids/"
                               f"completion_mask [N, Lc], got { {k: list(v) for k, v in shapes.items()} }")


def _temperature_from(metadata: Any) -> float | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RefProtocolError("__metadata__ must be a JSON object of strings")
    if "temperature" not in metadata:
        return None
    try:
        return float(metadata["temperature"])
    except ValueError as err:
        raise RefProtocolError(f"__metadata__.temperature {_short(metadata['temperature'])} is not a number") from err


def encode_response(ref_logprobs: Tensor) -> bytes:
    """The response body: {ref_logprobs: float32 [N, Lc]}."""
    return safetensors.torch.save({RESPONSE_KEY: ref_logprobs.detach().to("cpu", torch.float32).contiguous()})


def decode_response(body: bytes, shape: tuple[int, int]) -> Tensor:
    """Parse a response body and check it holds float32 ``ref_logprobs`` of ``shape``; else RefProtocolError."""
    header = _read_header(body)
    header.pop("__metadata__", None)
    entry = header.get(RESPONSE_KEY)
    if set(header) != {RESPONSE_KEY} or not isinstance(entry, dict) or entry.get("dtype") != "F32":
        raise RefProtocolError(f"the response must hold only {RESPONSE_KEY} (float32), got {_short(sorted(header))}")
    if entry.get("shape") != list(shape):
        raise RefProtocolError(f"{RESPONSE_KEY}: shape {_short(entry.get('shape'))} but the request was {list(shape)}")
    try:
        return safetensors.torch.load(body)[RESPONSE_KEY]
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:
        raise RefProtocolError(f"the response is not valid safetensors: {err}") from err


# ---------------------------------------------------------------- server


def build_app(
    model: torch.nn.Module,
    *,
    temperature: float,
    token: str | None,
    max_request_bytes: int,
    micro_batch_size: int | None,
    model_name: str | None = None,
):
    """A FastAPI app serving ``model``'s log-probs (see the module docstring for the protocol).

    Args:
        model: a causal LM; put in eval mode with gradients off (the server owns it).
        temperature: the sampling temperature the log-probs are computed at (> 0).
        token: when set, every request needs ``Authorization: Bearer <token>``.
        max_request_bytes: larger bodies get 413 without being parsed.
        micro_batch_size: rows per forward pass; None = a request's rows all at once.
        model_name: reported by /v1/health; default ``model.name_or_path``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    model.eval()
    model.requires_grad_(False)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    name = model_name or str(getattr(model, "name_or_path", "") or type(model).__name__)
    expected_auth = None if token is None else f"Bearer {token}".encode()
    forward_lock = threading.Lock()  # one forward at a time: the device holds one batch's activations
    app = FastAPI(title="grpo reference log-probs", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message, "protocol": PROTOCOL}, status_code=status,
                            headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    def authorised(request: Request) -> bool:
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

    def compute(req: RefRequest) -> Tensor:
        with forward_lock, torch.no_grad():
            return completion_logprobs(model, req.prompt_ids, req.prompt_mask, req.completion_ids,
                                       req.completion_mask, temperature, micro_batch_size)  # [N, Lc]

    @app.get("/v1/health")
    def health(request: Request):
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        return {"protocol": PROTOCOL, "model": name, "temperature": temperature, "vocab_size": vocab_size,
                "max_request_bytes": max_request_bytes}

    @app.post("/v1/logprobs")
    async def logprobs(request: Request):
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        version = request.headers.get(PROTOCOL_HEADER)
        if version is None:
            return error(400, f"missing header {PROTOCOL_HEADER} (this server speaks protocol {PROTOCOL})")
        if version.strip() != str(PROTOCOL):
            return error(426, f"{PROTOCOL_HEADER}: {version[:20]!r} is not supported; this server speaks {PROTOCOL}")
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != CONTENT_TYPE:
            return error(415, f"Content-Type must be {CONTENT_TYPE}, got {content_type!r}")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                return error(400, f"Content-Length {declared[:20]!r} is not a number")
            if int(declared) > max_request_bytes:
                return error(413, f"body of {declared} bytes exceeds the limit of {max_request_bytes}")
        body = bytearray()
        async for chunk in request.stream():  # counted as it arrives: chunked bodies have no Content-Length
            body += chunk
            if len(body) > max_request_bytes:
                return error(413, f"body exceeds the limit of {max_request_bytes} bytes")
        try:
            req = decode_request(bytes(body), vocab_size)
        except RefProtocolError as err:
            return error(err.status, str(err))
        if req.temperature is not None and req.temperature != temperature:
            return error(400, f"the client expects temperature {req.temperature}, but this server computes "
                              f"log-probs at {temperature}")
        try:
            ref_logprobs = await run_in_threadpool(compute, req)  # the event loop keeps answering /health
        except Exception as err:  # any forward failure (OOM, ...) becomes a 500, logged; the server lives on
            logger.exception("ref server: forward pass failed for a [%d, %d] request",
                             req.completion_ids.shape[0], req.prompt_ids.shape[1] + req.completion_ids.shape[1])
            return error(500, f"forward pass failed: {type(err).__name__}: {str(err)[:200]}")
        return Response(encode_response(ref_logprobs), media_type=CONTENT_TYPE,
                        headers={PROTOCOL_HEADER: str(PROTOCOL)})

    return app


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
    Raises ConfigError (before loading anything) for a non-loopback host without a token, an unset
    token variable, an unknown dtype or a non-positive temperature.
    """
    import uvicorn
    from transformers import AutoModelForCausalLM

    from grpo.models import DTYPES, resolve_device

    token = None
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise ConfigError(f"token_env: the environment variable {token_env!r} is unset or empty")
    if not is_loopback(host) and token is None:
        raise ConfigError(f"host: refusing to serve on {host!r} without authentication; bind 127.0.0.1 or set a "
                          "token with token_env (anyone who can reach the port could use the model otherwise)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)} (or null = as stored)")
    if temperature <= 0:
        raise ConfigError(f"temperature: must be > 0, got {temperature}")
    if max_request_mb <= 0:
        raise ConfigError(f"max_request_mb: must be > 0, got {max_request_mb}")

    kwargs = {"dtype": DTYPES[dtype]} if dtype is not None else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(resolve_device(device)).eval()
    app = build_app(model, temperature=temperature, token=token, max_request_bytes=int(max_request_mb * 2**20),
                    micro_batch_size=micro_batch_size, model_name=model_path)
    shown_host = f"[{host}]" if ":" in host else host
    logger.info("ref server: %s at temperature %g on %s, listening on http://%s:%d (auth: %s)", model_path,
                temperature, next(model.parameters()).device, shown_host, port, "bearer token" if token else "none")
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))


def run_ref_server(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    temperature: float = 1.0,
    token_env: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    max_request_mb: float = 64.0,
    micro_batch_size: int | None = None,
) -> None:
    """Serve reference log-probs until interrupted (arguments as ``make_server``)."""
    server = make_server(model_path, host, port, temperature, token_env, device, dtype, max_request_mb,
                         micro_batch_size)
    print(f"grpo ref server: http://{f'[{host}]' if ':' in host else host}:{port}/v1", flush=True)
    server.run()


# ---------------------------------------------------------------- client


class RefServerClient:
    """Client of a reference log-prob server.

    Connection errors and 5xx answers are retried ``retries`` times with exponential backoff
    (``backoff_s``, ``2*backoff_s``, ...); a read timeout or a 4xx is not (retrying cannot fix it) and
    raises ``RefServerError`` with the status and an excerpt of the body. With ``temperature`` set the
    server refuses to answer at another temperature (so a mismatch cannot silently skew the KL).
    """

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, temperature: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.temperature = temperature
        self._session = requests.Session()
        self._server_info: dict[str, Any] | None = None  # from the last health(): the server's body limit
        self._headers = {PROTOCOL_HEADER: str(PROTOCOL)}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"

    def logprobs(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                 completion_mask: Tensor) -> Tensor:
        """[N, Lc] float32 reference log-probs of the completion tokens (CPU)."""
        body = encode_request(prompt_ids, prompt_mask, completion_ids, completion_mask, self.temperature)
        limit = (self._server_info or {}).get("max_request_bytes")
        if isinstance(limit, int) and len(body) > limit:  # the server would cut the upload off mid-send
            raise RefServerError(f"{self.url}/v1/logprobs: a request of {len(body)} bytes exceeds the server's limit "
                                 f"of {limit}; send fewer rows per call or raise the server's max_request_mb")
        response = self._request("POST", "/v1/logprobs", data=body,
                                 headers={**self._headers, "Content-Type": CONTENT_TYPE})
        if response.headers.get(PROTOCOL_HEADER) != str(PROTOCOL):
            raise RefServerError(f"{self.url}/v1/logprobs answered without {PROTOCOL_HEADER}: {PROTOCOL}; "
                                 "is it a grpo reference server of this version?")
        try:
            return decode_response(response.content, tuple(completion_ids.shape))
        except RefProtocolError as err:
            raise RefServerError(f"{self.url}/v1/logprobs: bad response: {err}") from err

    def health(self) -> dict[str, Any]:
        """The server's /v1/health answer (protocol, model, temperature, vocab_size)."""
        response = self._request("GET", "/v1/health", headers=self._headers, retries=0,
                                 timeout_s=min(self.timeout_s, 10.0))
        try:
            info = response.json()
        except ValueError as err:
            raise RefServerError(f"{self.url}/v1/health: not JSON: {response.text[:BODY_EXCERPT_CHARS]!r}",
                                 status=response.status_code) from err
        protocol = info.get("protocol") if isinstance(info, dict) else None
        if protocol != PROTOCOL:
            raise RefServerError(f"{self.url}/v1/health: the server speaks protocol {protocol!r}, this client "
                                 f"speaks {PROTOCOL}", status=response.status_code)
        self._server_info = info
        return info

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll /v1/health until it answers; return it. Raises TimeoutError (with the last error) after
        ``timeout_s``, and RefServerError at once on a 4xx (a wrong token does not fix itself)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.health()
            except RefServerError as err:
                if err.status is not None and err.status < 500:
                    raise  # a wrong token or another protocol: waiting does not help
                last = err
            if time.monotonic() >= deadline:
                raise TimeoutError(f"reference server {self.url} not ready within {timeout_s:g} s: {last}")
            time.sleep(poll_s)

    def _request(self, method: str, path: str, *, retries: int | None = None, timeout_s: float | None = None,
                 **kwargs) -> requests.Response:
        retries = self.retries if retries is None else retries
        url = self.url + path
        for attempt in range(retries + 1):
            try:
                response = self._session.request(method, url, timeout=timeout_s or self.timeout_s, **kwargs)
            except requests.ConnectionError as err:  # includes ConnectTimeout; not ReadTimeout
                if attempt == retries:
                    raise RefServerError(f"{method} {url}: cannot connect after {retries + 1} attempts: {err}") from err
                logger.warning("ref server %s: %s; retrying (%d/%d)", url, err, attempt + 1, retries)
            except requests.Timeout as err:  # the server took the request: running it again would not be faster
                raise RefServerError(f"{method} {url}: no answer within {timeout_s or self.timeout_s:g} s") from err
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500 or attempt == retries:
                    raise RefServerError(f"{method} {url}: status {response.status_code}: "
                                         f"{response.text[:BODY_EXCERPT_CHARS]!r}", status=response.status_code)
                logger.warning("ref server %s: status %d; retrying (%d/%d)", url, response.status_code, attempt + 1,
                               retries)
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._session.close()
