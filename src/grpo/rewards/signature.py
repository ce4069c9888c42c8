"""The reward function signature shared with TRL 1.16.

A reward function is called by keyword only, exactly as TRL's ``GRPOTrainer`` calls it:

    fn(prompts=..., completions=..., completion_ids=..., **columns,
       trainer_state=..., log_extra=..., log_metric=...)

- ``prompts``: list[str] or list of message lists (conversational), length N;
- ``completions``: list[str] or list of message lists ``[{"role": "assistant", "content": ...}]``, length N;
- ``completion_ids``: N token-id lists (each completion's tokens up to and including EOS);
- ``columns``: the dataset's other columns as keyword lists of length N (e.g. ``answer=[...]``);
- ``trainer_state``, ``log_extra``, ``log_metric``: see ``context.py``;
- a function names what it uses and accepts the rest with ``**kwargs``, as TRL's do;
- returns ``list[float | None]`` of length N, where None means "abstain" for that sample;
- it may be ``async def`` (awaited with the other async rewards of the step).

Its ``__name__`` names it in logs (``reward/<name>``), as in TRL. A factory builds one from a tag
style and parameters; the registry (``registry.py``) maps names to factories.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo.errors import RewardError  # noqa: F401  (re-exported: reward code raises it)

RewardCallable = Callable[..., list[float | None]]
RewardFactory = Callable[..., RewardCallable]


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Set ``fn.__name__`` (and ``__qualname__``) to ``name`` and return ``fn``."""
    fn.__name__ = name
    fn.__qualname__ = name
    return fn
