"""One rule for a failure on N ranks: the first rank whose run fails records it in the process group's store,
every other rank sees it within a second and exits with the same status, and only the first prints its error,
naming its rank and host. No rank waits in a collective once a rank failed: a rank blocked in a broadcast with
a failed peer would otherwise wait for the collective timeout (30 minutes), printing nothing.

The store is torch.distributed's own (torchrun's agent hosts it, or rank 0 under DeepSpeed's launcher and
plain ``env://``), so this works across hosts with nothing more to configure. A rank that sees the failure
exits with ``os._exit``: its main thread may be inside a collective that cannot be interrupted.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from grpo.errors import EXIT_FAILED, exit_status

FAILURE_KEY = "grpo/failure"
SEEN_KEY = "grpo/failure_seen"
POLL_S = 0.5
STORE_LOST_POLLS = 6  # the store gone for this many polls in a row: its host (node 0) is gone
ACK_WAIT_S = 5.0  # how long a rank that hosts the store stays up for the others to read the failure


@dataclass(frozen=True)
class RankFailure:
    """The first failure of a run: which rank, on which host, its exit status and its message."""

    rank: int
    host: str
    code: int
    message: str

    def stop_line(self, rank: int) -> str:
        """What another rank prints as it stops (the message itself is printed once, by the failed rank)."""
        return (f"grpo: rank {rank} on {socket.gethostname()} stops: rank {self.rank} on {self.host} failed "
                f"(exit {self.code}; its error is above or in that host's log)")


def failure_status(err: BaseException) -> tuple[int, str]:
    """The exit status and the message of an exception that ends a run: the command line's one-line message
    for the errors it knows (``grpo.errors.exit_status``), else the traceback with status 1."""
    known = exit_status(err)
    if known is not None:
        return known
    return EXIT_FAILED, "".join(traceback.format_exception(err)).rstrip()


class FailureWatch:
    """This rank's side of the rule: ``fail`` records (or learns) the run's first failure; a daemon thread
    polls the store and ends this process when another rank failed (``exit`` is ``os._exit`` but in tests)."""

    def __init__(self, store, rank: int, world_size: int, hosts_store: bool, exit=os._exit, poll_s: float = POLL_S):
        self.store, self.rank, self.world_size, self.hosts_store = store, rank, world_size, hosts_store
        self._exit, self._poll_s = exit, poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcome: RankFailure | None = None  # the run's first failure, once this rank knows it
        self._thread = threading.Thread(target=self._watch, name="grpo-rank-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean end: the ranks meet in the last barrier, and then the store goes away)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self._poll_s)

    def fail(self, err: BaseException) -> RankFailure:
        """Record this rank's failure unless another rank's came first; print the message if it is the first
        (else one line saying which rank failed); returns the first failure (its ``code`` is the exit status)."""
        with self._lock:
            if self.outcome is not None:
                return self.outcome
            self._stop.set()
            code, message = failure_status(err)
            mine = RankFailure(self.rank, socket.gethostname(), code, message)
            first = self._record(mine)
            self.outcome = first
        if first == mine:
            print(f"grpo: rank {self.rank} of {self.world_size} on {mine.host}: {_without_prefix(message)}",
                  file=sys.stderr, flush=True)
            self._linger()
        else:
            print(first.stop_line(self.rank), file=sys.stderr, flush=True)
            self._acknowledge()
        return first

    def _record(self, mine: RankFailure) -> RankFailure:
        value = json.dumps(mine.__dict__)
        try:  # the first writer wins: compare_set sets the key only while it is unset
            current = self.store.compare_set(FAILURE_KEY, "", value)
            return RankFailure(**json.loads(current))
        except Exception:  # the store is gone with its host: nobody else can be told, so this rank is first
            return mine

    def _linger(self) -> None:
        # The store lives in this process (rank 0 without torchrun's agent): stay until the others read it.
        if not self.hosts_store:
            return
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            while self.store.add(SEEN_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            pass  # a store that fails here has no reader to wait for

    def _watch(self) -> None:
        lost = 0
        while not self._stop.wait(self._poll_s):
            try:
                failed = self.store.check([FAILURE_KEY])
                lost = 0
            except Exception as err:  # the store's host is gone (torchrun's node 0, or rank 0 itself)
                lost += 1
                if lost >= STORE_LOST_POLLS:
                    self._end(RankFailure(0, "?", EXIT_FAILED, str(err)),
                              f"grpo: rank {self.rank} on {socket.gethostname()} stops: the run's store (torchrun's "
                              f"node 0, or rank 0) is unreachable, so its host or rank 0 is gone: {err}")
                    return
                continue
            if failed:
                first = RankFailure(**json.loads(self.store.get(FAILURE_KEY)))
                if first.rank != self.rank:
                    self._end(first, first.stop_line(self.rank))
                return

    def _end(self, first: RankFailure, line: str) -> None:
        with self._lock:
            if self.outcome is not None:  # this rank's own failure is being handled by its main thread
                return
            self.outcome = first
        print(line, file=sys.stderr, flush=True)
        self._acknowledge()
        sys.stdout.flush()
        self._exit(first.code)

    def _acknowledge(self) -> None:
        try:  # lets a failed rank that hosts the store leave (``_linger``)
            self.store.add(SEEN_KEY, 1)
        except Exception:
            pass  # the store is gone: nobody waits for this


def _without_prefix(message: str) -> str:
    return message[len("grpo: "):] if message.startswith("grpo: ") else message


# This process's watch, for the command line's error handling (one process group per process, as torch's).
_CURRENT: list[FailureWatch] = []


def start_watch(store, rank: int, world_size: int, hosts_store: bool) -> FailureWatch:
    """Watch the store for another rank's failure from now until ``stop_watch``."""
    stop_watch()
    watch = FailureWatch(store, rank, world_size, hosts_store).start()
    _CURRENT.append(watch)
    return watch


def current_watch() -> FailureWatch | None:
    """The watch of this process's process group, if it has one."""
    return _CURRENT[-1] if _CURRENT else None


def stop_watch() -> None:
    while _CURRENT:
        _CURRENT.pop().stop()
