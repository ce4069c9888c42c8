"""The reward function signature shared with TRL.

A reward function is called as ``fn(prompts, completions, **columns)`` and returns one value per
completion:

- ``prompts``: list[str] or list of message lists (conversational), length N;
- ``completions``: list[str] or list of message lists ``[{"role": "assistant", "content": ...}]``, length N;
- ``columns``: the dataset's other columns as keyword lists of length N (e.g. ``answer=[...]``);
  a function must accept and ignore keywords it does not use (``**kwargs``), as TRL's do;
- returns ``list[float | None]`` of length N, where None means "abstain" for that sample.

Its ``__name__`` names it in logs (``reward/<name>``), as in TRL. A factory builds one from a tag
style and parameters; the registry (``registry.py``) maps names to factories.
"""

from __future__ import annotations

from grpo.errors import RewardError  # noqa: F401  (re-exported: reward code raises it)

from collections.abc import Callable
from typing import Any

RewardCallable = Callable[..., list[float | None]]
RewardFactory = Callable[..., RewardCallable]


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Set ``fn.__name__`` (and ``__qualname__``) to ``name`` and return ``fn``."""
    fn.__name__ = name
    fn.__qualname__ = name
    return fn
