"""``decoupled.weight_sync: broadcast``: the trainer's rank 0 sends each new version of the full weights to
the samplers over a ``grpo.weight_store.broadcast.WeightBroadcast`` group, then announces it with a path
``broadcast:<version folder>``; a sampler's background thread receives every version and keeps the newest.

The files stay the record: after each broadcast rank 0 also writes the version to the weight store, in a
thread, off the step's critical path (the next publish waits for it). So a sampler that is not in the group
(it started late, was restarted, or its receive failed) loads the announced version from files as it
always did, and nothing waits for a member that will never come. When a broadcast fails (a sampler died)
or the group did not form within ``decoupled.peer_timeout_s``, rank 0 warns once and publishes that
version and every later one to files only, announcing file paths.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from grpo.weight_store import LoadedWeights, WeightStore
from grpo.weight_store.broadcast import BroadcastError, WeightBroadcast

logger = logging.getLogger(__name__)

BROADCAST_PREFIX = "broadcast:"  # an announced path that says the version comes by broadcast


def is_broadcast(path: str) -> bool:
    """Whether an announced weights path says the version was broadcast (its files may still be in writing)."""
    return path.startswith(BROADCAST_PREFIX)


class BroadcastPublisher:
    """Trainer rank 0's side: forms the group in a thread (members have ``join_timeout_s``), then
    ``publish(version, state) -> announced path`` broadcasts and mirrors to files, or writes files only once
    the group is gone."""

    def __init__(self, store: WeightStore, keep: int, connect: Callable[[], WeightBroadcast],
                 form_timeout_s: float) -> None:
        self.store, self.keep, self.form_timeout_s = store, keep, form_timeout_s
        self.group: WeightBroadcast | None = None
        self.given_up = threading.Event()  # publish stopped waiting for the group: files only, whatever forms
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-to-files")
        self.written: Future | None = None  # the newest version's file write
        self.forming = threading.Thread(target=self._form, args=(connect,), name="weights-group", daemon=True)
        self.forming.start()

    def _form(self, connect: Callable[[], WeightBroadcast]) -> None:
        try:
            group = connect()
        except BroadcastError as exc:
            logger.warning("weights go through files: %s", exc)
            return
        if not self.given_up.is_set():
            self.group = group

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> str:
        """Send ``version`` (full weights, tensors owned by the caller's copy) and return the path to announce."""
        # gloo's group creation can outlive its own timeout (a member that tried a wrong address and gave up):
        # wait as long as the members may take to join, then go on with files (the thread cannot be stopped)
        if not self.given_up.is_set():
            self.forming.join(self.form_timeout_s)
        if self.forming.is_alive() and not self.given_up.is_set():
            self.given_up.set()
            logger.warning("weights go through files: the broadcast group did not form within %.0f s (can every "
                           "sampler reach trainer rank 0's address? GLOO_SOCKET_IFNAME picks gloo's interface where "
                           "the host name resolves to loopback)", self.form_timeout_s)
        self._wait_written()  # one writer at a time, in version order
        if self.group is not None:
            started = time.perf_counter()
            try:
                self.group.send(version, state)
                logger.info("weights version %d broadcast to %d samplers in %.3f s", version, self.group.size - 1,
                            time.perf_counter() - started)
            except BroadcastError as exc:
                logger.warning("weight broadcast failed, weights go through files from version %d on: %s",
                               version, exc)
                self.group = None
            else:
                self.written = self.writer.submit(self.store.publish, version, state, kind="full", keep=self.keep)
                return BROADCAST_PREFIX + str(self.store.version_dir(version))
        return str(self.store.publish(version, state, kind="full", keep=self.keep))

    def _wait_written(self) -> None:
        if self.written is not None:
            written, self.written = self.written, None
            written.result()  # a failed write raises here

    def close(self) -> None:
        """Finish the last file write and tell the receivers the broadcasts are over."""
        try:
            self._wait_written()
        finally:
            self.writer.shutdown()
            if self.group is not None:
                self.group.close()


class ReceivedWeights:
    """A sampler's side: a daemon thread joins the group and receives every version, keeping the newest.
    ``newest(min_version)`` hands it over; None means "load from files" (not a member, or the thread failed)."""

    def __init__(self, connect: Callable[[], WeightBroadcast]) -> None:
        self._cond = threading.Condition()
        self._newest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._joined = False
        self._over = False  # failed, closed by the trainer, or never joined
        threading.Thread(target=self._run, args=(connect,), name="weights-receiver", daemon=True).start()

    def _run(self, connect: Callable[[], WeightBroadcast]) -> None:
        try:
            group = connect()
            with self._cond:
                self._joined = True
            while (received := group.receive()) is not None:
                with self._cond:
                    self._newest = received
                    self._cond.notify_all()
            logger.info("the trainer closed the weight broadcast")
        except BroadcastError as exc:
            logger.warning("weights come through files from now on: %s", exc)
        finally:
            with self._cond:
                self._over = True
                self._cond.notify_all()

    def newest(self, min_version: int, timeout_s: float) -> LoadedWeights | None:
        """The newest received version if it is ``min_version`` or newer (waiting for it while the thread
        still receives, up to ``timeout_s``); None when the weights must come from files."""
        with self._cond:
            if not self._joined:
                return None  # the trainer broadcast without this sampler: it is not in the group
            self._cond.wait_for(lambda: self._over or (self._newest is not None and self._newest[0] >= min_version),
                                timeout=timeout_s)
            if self._newest is None or self._newest[0] < min_version:
                return None
            (version, state), self._newest = self._newest, None
        return LoadedWeights(version=version, kind="full", state_dict=state, adapter_config=None)
