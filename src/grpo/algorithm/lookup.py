"""Name lookup for the algorithm's registries (advantage estimators and scales, loss aggregations,
importance-sampling levels): an unknown name is an error listing the known ones."""

from __future__ import annotations


def lookup(registry: dict, kind: str, name: str):
    """``registry[name]``, or ``ValueError("unknown <kind> <name>; known: [...]")``."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None
