"""One event loop on a daemon thread for async reward functions (an LLM judge, a sandbox).

TRL runs async rewards the same way (``start_event_loop_in_daemon``): the loop lives as long as the
process, so a client a reward keeps between calls (an ``aiohttp`` session, say) stays bound to the loop
it was made on; a fresh ``asyncio.run`` per step would close it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine: async functions, partials of them, and instances
    whose ``__call__`` is async (as TRL's ``is_async_callable``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="grpo-async-rewards", daemon=True).start()
        return _loop


def run_coroutine(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` on the shared loop and return its result (its exception is raised here)."""
    async def wrapper() -> T:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrapper(), event_loop()).result()
