"""The run a command line names: its recipe (grpo's default recipe when it names none) and overrides, resolved
once (``grpo.config.resolve_run``) by every command that reads a run (``grpo config``, ``grpo train``, the
decoupled roles, ``grpo memory``), with the resolution's notes said once on stderr."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from grpo.config import RunConfig, resolve_run


def command_line_config(recipe: str | None, overrides: Iterable[str], say_notes: bool = True) -> RunConfig:
    """The resolved config of ``recipe`` + ``overrides``; with ``say_notes`` its notes (e.g. the default recipe's
    rewards set aside for another task's) printed to stderr by the first rank only (RANK 0 or unset). The
    decoupled roles say none: the launcher that starts them said them."""
    run = resolve_run(recipe, list(overrides))
    if say_notes and os.environ.get("RANK", "0") == "0":
        for note in run.notes():
            print(f"grpo: {note}", file=sys.stderr)
    return run.config
