"""Small settings the decoupled roles share: the shared token and message limits."""

from __future__ import annotations

import os

from grpo.config import ConfigError, RunConfig


def shared_token(cfg: RunConfig) -> str:
    """The token from ``decoupled.token_env`` ("" when none is configured)."""
    name = cfg.decoupled.token_env
    if not name:
        return ""
    token = os.environ.get(name, "")
    if not token:
        raise ConfigError(f"decoupled.token_env: environment variable {name} is empty or not set")
    return token


def max_message_bytes(cfg: RunConfig) -> int:
    return cfg.decoupled.max_message_mb * 1024 * 1024
