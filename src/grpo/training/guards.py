"""Guards of a running loop: too many non-finite steps in a row abort it (``SkipGuard``), and Ctrl-C
waits for the step in flight to end (``DeferredInterrupt``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from grpo.errors import TrainingAborted


class SkipGuard:
    """Counts steps whose updates were all skipped (non-finite gradients); too many in a row aborts
    the run, leaving the last good checkpoint as it is, instead of training on garbage for hours."""

    def __init__(self, max_consecutive: int, updates_per_step: int):
        self.max_consecutive, self.updates_per_step = max_consecutive, updates_per_step
        self.consecutive = 0

    def record(self, step: int, train_stats: dict) -> None:
        all_skipped = train_stats["skipped_updates"] >= self.updates_per_step
        self.consecutive = self.consecutive + 1 if all_skipped else 0
        if self.consecutive >= self.max_consecutive:
            raise TrainingAborted(
                f"step {step}: the gradients were non-finite (NaN/inf) in {self.consecutive} consecutive steps "
                f"(optim.max_skipped_steps {self.max_consecutive}); those updates were skipped and the last "
                "checkpoint is intact. Lower the learning rate or check the rewards and data.")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (what SLURM and torchrun send before a kill) raises ``KeyboardInterrupt`` in the block, so a
    run stopped that way saves its last finished step as Ctrl-C does. Main thread only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class RankAgreedStop:
    """Ctrl-C or SIGTERM in a run of several ranks: note it, and let every rank stop after the same step
    (``requested`` is compared at each step's end by the loop): a rank that stopped alone would leave the
    others waiting in a collective. A second signal stops at once (``forced``: nothing is saved then)."""

    def __init__(self) -> None:
        self.requested = False
        self.forced = False
        self._previous: dict = {}

    def __enter__(self) -> "RankAgreedStop":
        if threading.current_thread() is not threading.main_thread():
            return self

        def note(signum, frame) -> None:
            if self.requested:
                self.forced = True
                raise KeyboardInterrupt
            self.requested = True
            os.write(2, f"\ngrpo: {signal.Signals(signum).name}: every rank stops after this step and saves it "
                        f"(again to stop at once, without saving)\n".encode())

        self._previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            fallback = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, fallback if handler is None else handler)


class DeferredInterrupt:
    """Hold Ctrl-C (SIGINT) and SIGTERM while the block runs, then raise ``KeyboardInterrupt`` at its end.

    The training loop wraps each step's update, logging and checkpoint in one: an interrupt there would
    leave weights that belong to no step (half the ``num_iterations`` updates done, or the update done
    but not logged), and a checkpoint of them under the previous step's number would train the step's
    batch twice after resuming. A second Ctrl-C stops at once and sets ``forced``: the caller must then
    save nothing (the last checkpoint stays the newest). Outside the main thread (where signal handlers
    cannot be installed, and where SIGINT is never delivered) it does nothing.
    """

    def __init__(self) -> None:
        self.received = False
        self.forced = False

    @contextmanager
    def holding(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def hold(signum, frame) -> None:
            if self.received:
                self.forced = True
                raise KeyboardInterrupt
            self.received = True
            # os.write, not print: a handler that prints while the interrupted code is printing to the same
            # buffered stream fails with "reentrant call".
            os.write(2, f"\ngrpo: {signal.Signals(signum).name}: finishing this step and saving it (Ctrl-C again to "
                        f"stop at once, without saving it)\n".encode())

        previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            # None: the previous handler was not installed from Python; Python's own is the closest.
            for sig, handler in previous.items():
                fallback = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                signal.signal(sig, fallback if handler is None else handler)
        if self.received:
            raise KeyboardInterrupt
