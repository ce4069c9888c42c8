"""``opt``: a config field with its documentation and constraints (shared by the schema modules)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, choices: tuple | None = None, ge=None, gt=None, le=None) -> Any:
    """A dataclass field with its documentation and constraints in ``metadata``."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)
