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


# Keys a role may set for itself: which sampler it is, where it runs, how it was started (resume/overwrite
# are the trainer's), device choices that give the same values; everything else must match across roles.
ROLE_LOCAL_KEYS = frozenset({
    "decoupled.sampler_index", "decoupled.sampler_device", "decoupled.ref_server_device", "decoupled.ref_server_url",
    "decoupled.ref_server_host", "decoupled.advertise_host", "train.resume", "train.overwrite", "train.device", "log.progress_bar",
    "model.sdpa_backends", "train.shared_prompt_pass", "train.column_bucket"})


def config_fingerprint(cfg: RunConfig) -> str:
    """A hash of the config every role must share (all keys but ``ROLE_LOCAL_KEYS``): a sampler started
    from another version of the recipe would make batches the trainer must not train on."""
    import hashlib
    import json

    from grpo.config import config_to_dict

    tree = config_to_dict(cfg)
    for key in ROLE_LOCAL_KEYS:
        section, name = key.split(".")
        tree[section].pop(name, None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def max_message_bytes(cfg: RunConfig) -> int:
    return cfg.decoupled.max_message_mb * 1024 * 1024
