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
    the run, leaving the last good checkpoint as it is, instead of training on garbage for hours.

    fp16's overflow skips (``fp16/overflow_updates``: the loss scale above 1, the loss finite) are not counted:
    they are the loss scaler at work, which halves its scale after each (from 2^16 it may take several at the
    start, the scaler's warm-up) until the scaled gradients fit float16. A non-finite loss, or an overflow at a
    scale of 1 or below (gradients too large for float16 unscaled), counts as any non-finite update does."""

    def __init__(self, max_consecutive: int, updates_per_step: int):
        self.max_consecutive, self.updates_per_step = max_consecutive, updates_per_step
        self.consecutive = 0

    def record(self, step: int, train_stats: dict) -> None:
        non_finite = train_stats["skipped_updates"] - train_stats.get("fp16/overflow_updates", 0.0)
        all_skipped = non_finite >= self.updates_per_step
        self.consecutive = self.consecutive + 1 if all_skipped else 0
        if self.consecutive >= self.max_consecutive:
            raise TrainingAborted(
                f"step {step}: the gradients were non-finite (NaN/inf) in {self.consecutive} consecutive steps "
                f"(optim.max_skipped_steps {self.max_consecutive}); those updates were skipped and the last "
                "checkpoint is intact. Lower the learning rate or check the rewards and data.")


@contextmanager
def _handling(handler, signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, then the previous handlers back. Main thread only
    (handlers cannot be installed elsewhere, and signals are delivered to it): elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        # None: the previous handler was not installed from Python; Python's own is the closest.
        for sig, old in previous.items():
            fallback = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, fallback if old is None else old)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (what SLURM and torchrun send before a kill) raises ``KeyboardInterrupt`` in the block, so a
    run stopped that way saves its last finished step as Ctrl-C does. Only the first: a scheduler may signal
    every process of a job and torchrun forward it as well, and a repeat must not cut the save short."""
    raised = []

    def interrupt(signum, frame) -> None:
        if not raised:
            raised.append(signum)
            raise KeyboardInterrupt

    with _handling(interrupt, (signal.SIGTERM,)):
        yield


class _NotedSignal:
    """A SIGINT/SIGTERM handler: the first signal is noted (``received``) and said on stderr; a Ctrl-C after
    it stops at once (``forced``, then ``KeyboardInterrupt``). A repeated SIGTERM is the same request: SLURM
    may signal every process of a job step while torchrun forwards the signal too."""

    def __init__(self, then: str) -> None:
        self.then = then
        self.received = False
        self.forced = False

    def __call__(self, signum, frame) -> None:
        if self.received:
            if signum == signal.SIGTERM:
                return
            self.forced = True
            raise KeyboardInterrupt
        self.received = True
        # os.write, not print: a handler that prints while the interrupted code is printing to the same
        # buffered stream fails with "reentrant call".
        os.write(2, f"\ngrpo: {signal.Signals(signum).name}: {self.then} (Ctrl-C again to stop at once, "
                    f"without saving)\n".encode())


class RankAgreedStop:
    """Ctrl-C or SIGTERM in a run of several ranks: note it, and let every rank stop after the same step
    (``requested`` is compared at each step's end by the loop): a rank that stopped alone would leave the
    others waiting in a collective. A second signal stops at once (``forced``: nothing is saved then)."""

    def __init__(self) -> None:
        self._noted = _NotedSignal("every rank stops after this step and saves it")
        self._handling = _handling(self._noted)

    requested = property(lambda self: self._noted.received)
    forced = property(lambda self: self._noted.forced)

    def __enter__(self) -> "RankAgreedStop":
        self._handling.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handling.__exit__(*exc)


class DeferredInterrupt:
    """Hold Ctrl-C (SIGINT) and SIGTERM while the block runs, then raise ``KeyboardInterrupt`` at its end.

    The training loop wraps each step's update, logging and checkpoint in one: an interrupt there would
    leave weights that belong to no step (half the step's updates done, or the update done
    but not logged), and a checkpoint of them under the previous step's number would train the step's
    batch twice after resuming. A second Ctrl-C stops at once and sets ``forced``: the caller must then
    save nothing (the last checkpoint stays the newest). Outside the main thread (where signal handlers
    cannot be installed, and where SIGINT is never delivered) it does nothing.
    """

    def __init__(self) -> None:
        self._noted = _NotedSignal("finishing this step and saving it")

    received = property(lambda self: self._noted.received)
    forced = property(lambda self: self._noted.forced)

    @contextmanager
    def holding(self) -> Iterator[None]:
        with _handling(self._noted):
            yield
        if self.received:
            raise KeyboardInterrupt
