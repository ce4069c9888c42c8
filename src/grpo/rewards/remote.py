"""Reward computed by an HTTP endpoint (a sandbox, a judge model, a verifier service).

Wire format, version 1. One POST per batch, JSON body:

    {"version": 1,
     "prompts": [...],            # N strings, or N message lists
     "completions": [...],        # N strings, or N message lists
     "columns": {"answer": [...], ...}}   # the per-sample dataset columns, each a list of N

Keyword arguments that are not per-sample lists (e.g. TRL's ``trainer_state``) are not sent.
The endpoint answers 200 with ``{"rewards": [float or null, ...]}`` (N entries; null = abstain).

Failures: connection errors and 5xx answers are retried ``retries`` times with exponential backoff
(``backoff_s``, ``2*backoff_s``, ...); a read timeout, a 4xx, malformed JSON or a wrong number of
rewards are not (retrying cannot fix them) and raise ``RemoteRewardError`` naming the reward, the URL,
the status and an excerpt of the body.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import requests

from grpo.data.tags import TagStyle
from grpo.rewards.signature import RewardCallable, named

WIRE_VERSION = 1
BODY_EXCERPT_CHARS = 300


class RemoteRewardError(RuntimeError):
    """A remote reward endpoint could not give a valid answer."""


def _default_name(url: str) -> str:
    netloc = urlparse(url).netloc or url
    return "remote_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", netloc)


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback for numpy arrays / scalars and torch tensors (all have ``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def build_payload(prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Any]) -> dict[str, Any]:
    """The request body (see module docstring); only per-sample columns (sequences of length N) are kept."""
    n = len(completions)
    per_sample = {
        key: list(value)
        for key, value in columns.items()
        if hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)) and len(value) == n
    }
    return {"version": WIRE_VERSION, "prompts": list(prompts), "completions": list(completions), "columns": per_sample}


def parse_rewards(body: Any, n: int) -> list[float | None]:
    """Validate a response body: ``{"rewards": [...]}`` with n numbers or nulls. Raises ValueError."""
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
        raise ValueError('expected a JSON object {"rewards": [...]}')
    rewards = body["rewards"]
    if len(rewards) != n:
        raise ValueError(f"got {len(rewards)} rewards for {n} completions")
    for i, value in enumerate(rewards):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"reward at index {i} is {value!r}, expected a number or null")
    return [None if v is None else float(v) for v in rewards]


def make_remote_reward(
    tag_style: TagStyle | str | None = None,
    *,
    url: str,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    token: str | None = None,
    token_env: str | None = None,
    name: str | None = None,
) -> RewardCallable:
    """Return a reward function that POSTs each batch to ``url`` (see module docstring).

    Args:
        tag_style: unused (accepted so every registry factory has the same call shape).
        url: the endpoint, e.g. "http://judge:8000/score".
        timeout_s: per-request timeout in seconds, for connecting and for reading the answer.
        retries: extra attempts after a connection error or a 5xx answer (0: try once).
        backoff_s: sleep before the first retry; doubled before each later one.
        token: bearer token sent as ``Authorization: Bearer <token>``.
        token_env: name of an environment variable holding the token (keeps secrets out of configs);
            read once, here.
        name: the reward's name in logs; default ``remote_<host>_<port>``.
    """
    token = _checked_token(url, timeout_s, retries, backoff_s, token, token_env)
    reward_name = name or _default_name(url)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    endpoint = RemoteEndpoint(url, reward_name, headers, timeout_s, retries, backoff_s, requests.Session())

    def remote_reward(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None,
                      trainer_state: Any = None, log_extra: Any = None, log_metric: Any = None,
                      **columns: Any) -> list[float | None]:
        # TRL's completion_ids and context keywords are not part of wire format 1: only the columns go.
        try:
            data = json.dumps(build_payload(prompts, completions, columns), default=_jsonable)
        except TypeError as error:
            raise endpoint.fail(f"cannot encode the batch as JSON: {error}") from error
        response = endpoint.post(data)
        try:
            return parse_rewards(response.json(), len(completions))
        except ValueError as error:  # includes invalid JSON (requests' JSONDecodeError)
            raise endpoint.fail(f"bad answer: {error}", response) from error

    remote_reward.per_sample_fallback = False  # type: ignore[attr-defined]  # see reward_function.py
    return named(remote_reward, reward_name)


def _checked_token(url: str, timeout_s: float, retries: int, backoff_s: float, token: str | None,
                   token_env: str | None) -> str | None:
    """``make_remote_reward``'s arguments checked (a ValueError naming the bad one); the bearer token, or None."""
    if urlparse(url).scheme not in ("http", "https"):
        raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
    if timeout_s <= 0 or retries < 0 or backoff_s < 0:
        raise ValueError(
            f"remote reward needs timeout_s > 0, retries >= 0, backoff_s >= 0; got "
            f"timeout_s={timeout_s}, retries={retries}, backoff_s={backoff_s}"
        )
    if token is not None and token_env is not None:
        raise ValueError("remote reward: give token or token_env, not both")
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise ValueError(f"remote reward: environment variable {token_env!r} (token_env) is not set")
    return token


@dataclass(frozen=True)
class RemoteEndpoint:
    """Where a remote reward POSTs, and how it retries (see the module docstring)."""

    url: str
    name: str
    headers: dict[str, str]
    timeout_s: float
    retries: int
    backoff_s: float
    session: requests.Session

    def fail(self, message: str, response: requests.Response | None = None) -> RemoteRewardError:
        """The error naming the reward, the URL and (with ``response``) the status and an excerpt of the body."""
        detail = ""
        if response is not None:
            detail = f" (HTTP {response.status_code}; body: {response.text[:BODY_EXCERPT_CHARS]!r})"
        return RemoteRewardError(f"remote reward {self.name!r} at {self.url}: {message}{detail}")

    def post(self, data: str) -> requests.Response:
        """The 200 answer to ``data``: connection errors and 5xx answers retried with exponential backoff; a
        read timeout or another status is a ``RemoteRewardError``."""
        retries = self.retries
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            last_try = attempt == retries
            try:
                response = self.session.post(self.url, data=data, headers=self.headers, timeout=self.timeout_s)
            except requests.ConnectionError as error:  # includes ConnectTimeout: the server never saw it
                if last_try:
                    raise self.fail(f"connection failed after {retries + 1} attempts: {error}") from error
                continue
            except requests.Timeout as error:  # a read timeout: the server is slow, not gone
                raise self.fail(f"no answer within timeout_s={self.timeout_s} s") from error
            if response.status_code >= 500 and not last_try:
                continue
            if response.status_code != 200:
                attempts = f" after {retries + 1} attempts" if response.status_code >= 500 else ""
                raise self.fail(f"request failed{attempts}", response)
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")
