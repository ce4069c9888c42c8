"""Tools a model may call during a rollout (TRL's convention: plain typed functions with docstrings).

A tool is any callable whose signature and Google-style docstring ``transformers.utils.get_json_schema``
can read; its schema is what the chat template renders into the prompt. A call never stops the run: an
exception, a call past ``timeout_s`` or an unknown name becomes ``{"error": ...}`` text in the tool message
(TRL does the same for exceptions), counted as a failure. A result that is not text is turned into text
(JSON for dicts and lists, ``str`` otherwise) with a warning once per tool.

Sync tools run on worker threads so a timeout can be enforced; a thread that hangs past it cannot be killed,
so it is abandoned (it keeps its thread until it returns) and logged. Async tools run on the rewards' event
loop (``grpo.rewards.async_loop``) under ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from transformers.utils import get_json_schema

from grpo.rewards.async_loop import event_loop, is_async_callable

logger = logging.getLogger(__name__)

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpo-tool")


@dataclass(frozen=True)
class ToolOutcome:
    """One call's result as the conversation gets it: ``text`` is the tool message's content."""

    name: str
    text: str
    failed: bool  # raised, timed out, unknown tool or malformed call


# packages of grpo's optional extras a user's environment may import (OpenEnv clients import openenv)
EXTRA_OF_PACKAGE = {"openenv": "openenv", "openenv_core": "openenv", "reasoning_gym": "envs", "verifiers": "envs"}


def install_hint(exc: ImportError) -> str:
    """'; pip install 'grpo[EXTRA]'' when ``exc`` is a missing package of one of grpo's extras, else ''."""
    missing = (getattr(exc, "name", None) or "").partition(".")[0]
    extra = EXTRA_OF_PACKAGE.get(missing)
    return f"; {missing} is in grpo's optional extra: pip install 'grpo[{extra}]'" if extra else ""


def load_callable(spec: str, key: str) -> Callable:
    """``'package.module:attribute'`` -> the object; a clear ValueError naming ``key`` otherwise."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{key}: {spec!r} is not 'module:attribute' (e.g. grpo.multiturn.calculator:calculator)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key}: cannot import module {module_name!r} for {spec!r}: {exc}{install_hint(exc)}") from exc
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def tool_schema(fn: Callable) -> dict:
    """The JSON schema the chat template renders, read from ``fn``'s signature and docstring as TRL does;
    ValueError naming the tool when they cannot describe it (missing type hints or argument docs)."""
    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises its own TypeHintParsingException / DocstringParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: its schema cannot be read from the signature and "
                         f"docstring ({type(exc).__name__}: {exc}); tools need type hints and a Google-style "
                         "docstring with an Args: section, as TRL documents") from exc


def result_text(name: str, result: Any, warned: set[str]) -> str:
    """A tool's return value as the tool message's text."""
    if isinstance(result, str):
        return result
    if isinstance(result, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in result):
        return "".join(str(p.get("text", "")) for p in result)  # text content blocks, as TRL tools may return
    if name not in warned:
        warned.add(name)
        logger.warning("tool %r returned %s, not text: the conversation gets it as text", name, type(result).__name__)
    if isinstance(result, (dict, list, tuple)):
        try:
            return json.dumps(result)
        except TypeError:
            pass
    return str(result)


class Toolbox:
    """The tools of one rollout row: name -> callable, and their schemas for the chat template."""

    def __init__(self, tools: Sequence[Callable], timeout_s: float, warned: set | None = None):
        self.timeout_s = timeout_s
        self.tools: dict[str, Callable] = {}
        for fn in tools:
            name = getattr(fn, "__name__", None)
            if not name:
                raise ValueError(f"tool {fn!r} has no __name__: pass a function or a bound method")
            if name in self.tools and self.tools[name] is not fn:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self.tools[name] = fn
        self.schemas = [tool_schema(fn) for fn in self.tools.values()]
        # (tool, kind) already warned about: the first failure of each kind is a warning, the rest are info
        # lines (one set for the whole run, shared by every row's toolbox, so a flaky tool does not flood stderr)
        self.warned: set = warned if warned is not None else set()

    def start(self, name: str, arguments: Any) -> "PendingCall":
        """Start one call without waiting (a turn's calls, across rows, run together)."""
        fn = self.tools.get(name)
        if fn is None:
            return PendingCall(self, name, None, error=f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            return PendingCall(self, name, None, error=f"arguments must be an object, got {arguments!r}")
        if is_async_callable(fn):
            async def bounded():
                return await asyncio.wait_for(fn(**arguments), self.timeout_s)
            future = asyncio.run_coroutine_threadsafe(bounded(), event_loop())
        else:
            future = _POOL.submit(fn, **arguments)
        return PendingCall(self, name, future, deadline=time.monotonic() + self.timeout_s)

    def call(self, name: str, arguments: Any) -> ToolOutcome:
        """Run one call and wait for it; every failure becomes an error message for the model."""
        return self.start(name, arguments).outcome()


@dataclass
class PendingCall:
    """A started tool call; ``outcome()`` waits for it until its deadline."""

    toolbox: Toolbox
    name: str
    future: concurrent.futures.Future | None
    deadline: float = 0.0
    error: str | None = None  # failed before it started

    def outcome(self) -> ToolOutcome:
        name, timeout_s = self.name, self.toolbox.timeout_s
        if self.future is None:
            self._log("refused", "call to %r refused (answered with an error): %s", name, self.error)
            return ToolOutcome(name, json.dumps({"error": self.error}), failed=True)
        try:
            result = self.future.result(timeout=max(0.0, self.deadline - time.monotonic()) + 0.05)
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            self.future.cancel()  # an async call is cancelled; a sync thread cannot be, it is abandoned
            self._log("timeout", "tool %r took longer than rollout.tool_timeout_s = %g s; its call is an error",
                      name, timeout_s)
            return ToolOutcome(name, json.dumps({"error": f"timed out after {timeout_s:g} s"}), failed=True)
        except Exception as exc:  # the model reads the error and the run goes on, as in TRL
            self._log("raised", "tool %r raised %s: %s (the model gets the error)", name, type(exc).__name__, exc)
            return ToolOutcome(name, json.dumps({"error": str(exc) or type(exc).__name__}), failed=True)
        return ToolOutcome(name, result_text(name, result, self.toolbox.warned), failed=False)

    def _log(self, kind: str, message: str, *args) -> None:
        key = (self.name, kind)
        first = key not in self.toolbox.warned
        self.toolbox.warned.add(key)
        logger.log(logging.WARNING if first else logging.INFO,
                   message + (" (further ones are logged at INFO level)" if first else ""), *args)
