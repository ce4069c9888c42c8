"""The DeepSpeed config a run names (``train.deepspeed``): a JSON file's contents, or the mapping itself (what
``GRPOConfig(deepspeed={...})`` passes, as transformers' Trainer takes either). Read in one place, so the learner
and ``grpo memory`` cannot read it differently."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from grpo.errors import ConfigError


def read_deepspeed_json(value: str | dict) -> dict:
    """A copy of the DeepSpeed config ``value`` names; a ConfigError naming ``train.deepspeed`` (and the file's line)
    when the file is missing or is not a JSON object."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    file = Path(value)
    if not file.is_file():
        raise ConfigError(f"train.deepspeed: {value} not found")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"train.deepspeed: {value}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"train.deepspeed: {value}: the top level must be a JSON object, got {type(config).__name__}")
    return config
