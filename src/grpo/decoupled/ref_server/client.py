"""``RefServerClient``: reference log-probs from a reference server, with retries and checked answers."""

from __future__ import annotations

import logging
import time
from typing import Any

import requests
from torch import Tensor

from grpo.decoupled.ref_server.protocol import (
    CONTENT_TYPE,
    PROTOCOL,
    PROTOCOL_HEADER,
    RefProtocolError,
    decode_response,
    encode_request,
)

logger = logging.getLogger("grpo.decoupled.ref_server")  # the package's name: its modules log as one

BODY_EXCERPT_CHARS = 300


class RefServerError(RuntimeError):
    """The reference server could not give a valid answer (the message has the status and a body excerpt);
    ``status`` is the HTTP status, or None when there was no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


MAX_BACKOFF_S = 5.0  # longest pause between two attempts


class RefServerClient:
    """Client of a reference log-prob server.

    Connection errors and 5xx answers are retried ``retries`` times with exponential backoff
    (``backoff_s``, ``2*backoff_s``, ... at most ``MAX_BACKOFF_S``), or, with ``retry_s``, for as
    long as that many seconds (a server restarting after a crash comes back); a read timeout or a 4xx is not (retrying cannot fix it) and
    raises ``RefServerError`` with the status and an excerpt of the body. With ``temperature`` set the
    server refuses to answer at another temperature (so a mismatch cannot silently skew the KL).
    """

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, temperature: float | None = None, retry_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_s = retry_s
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
        by_time = retries is None and self.retry_s is not None
        retries = self.retries if retries is None else retries
        deadline = time.monotonic() + (self.retry_s or 0.0)
        url = self.url + path
        attempt = 0
        while True:
            last = time.monotonic() >= deadline if by_time else attempt == retries
            try:
                response = self._session.request(method, url, timeout=timeout_s or self.timeout_s, **kwargs)
            except requests.ConnectionError as err:  # includes ConnectTimeout; not ReadTimeout
                if last:
                    raise RefServerError(f"{method} {url}: cannot connect after {attempt + 1} attempts"
                                         f"{f' over {self.retry_s:g} s' if by_time else ''}: {err}") from err
                logger.warning("ref server %s: %s; retrying (attempt %d)", url, err, attempt + 1)
            except requests.Timeout as err:  # the server took the request: running it again would not be faster
                raise RefServerError(f"{method} {url}: no answer within {timeout_s or self.timeout_s:g} s") from err
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500 or last:
                    raise RefServerError(f"{method} {url}: status {response.status_code}: "
                                         f"{response.text[:BODY_EXCERPT_CHARS]!r}", status=response.status_code)
                logger.warning("ref server %s: status %d; retrying (attempt %d)", url, response.status_code,
                               attempt + 1)
            pause = min(self.backoff_s * 2**attempt, MAX_BACKOFF_S)
            if by_time:
                pause = max(0.0, min(pause, deadline - time.monotonic()))
            time.sleep(pause)
            attempt += 1

    def close(self) -> None:
        self._session.close()
