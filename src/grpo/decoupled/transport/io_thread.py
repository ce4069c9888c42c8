"""What both transport endpoints share: a daemon I/O thread that alone touches the ZeroMQ socket, runs
the commands other threads submit, wakes at once on a pipe, and reads messages of bounded size."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from grpo.decoupled.transport.common import MAX_MESSAGES_PER_WAKE, POLL_MS, TransportError

logger = logging.getLogger("grpo.decoupled.transport")  # the package's name: its modules log as one


class _Wakeup:
    """A pipe an I/O thread polls beside its socket, so other threads can wake it at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        with self._lock:  # never write to a closed (possibly reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the thread will wake

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


def _recv_bounded(socket: zmq.Socket, max_frames: int, max_bytes: int) -> tuple[list[bytes], str]:
    """One multipart message without blocking (zmq.Again when none is waiting): ``(frames, "")``.

    Keeps at most ``max_frames`` frames and ``max_bytes`` bytes in memory (ZeroMQ's MAXMSGSIZE bounds
    single frames only, not how many a message has): the rest of a larger message is read and
    discarded, and ``([first_frame], reason)`` returned (a ROUTER's first frame is the routing id).
    """
    first = socket.recv(zmq.NOBLOCK)
    frames, count, total, over = [first], 1, len(first), False
    while socket.getsockopt(zmq.RCVMORE):
        frame = socket.recv()  # the rest of a multipart message has arrived with its first frame
        count, total = count + 1, total + len(frame)
        over = over or count > max_frames or total > max_bytes
        if not over:
            frames.append(frame)
    if over:
        return [first], f"message of {count} frames and {total} bytes exceeds {max_frames} frames / {max_bytes} bytes"
    return frames, ""


class _IOThread:
    """Base of both endpoints: a daemon thread owning a socket, running commands other threads submit."""

    def _start_io(self, socket: zmq.Socket, name: str) -> None:
        self._socket = socket
        self._wakeup = _Wakeup()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._failure: BaseException | None = None
        self._close_linger_ms = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _check_open(self) -> None:
        self._raise_if_failed()
        if getattr(self, "_thread", None) is None or not self._thread.is_alive():
            raise TransportError(f"{type(self).__name__} is closed")

    def _submit(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the I/O thread (the only thread that touches the socket)."""
        self._check_open()
        with self._cond:
            self._commands.append(command)
        self._wakeup.set()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakeup.fileno(), zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._poll_ms()))
                self._wakeup.clear()
                while True:
                    with self._cond:
                        command = self._commands.popleft() if self._commands else None
                    if command is None:
                        break
                    command()
                if self._stopping:  # nothing after a last command (e.g. a heartbeat after the bye)
                    break
                if self._socket in ready:
                    self._receive_some()
                self._on_timer(time.monotonic())
        except Exception as exc:  # reported to the caller's next wait instead of dying silently
            logger.exception("%s: I/O thread failed", self._thread.name)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
        finally:
            self._close_sockets()

    def _receive_some(self) -> None:
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                frames, problem = _recv_bounded(self._socket, self._max_frames, self._max_incoming_bytes)
            except zmq.Again:
                return
            self._on_frames(frames, problem)

    def _stop_io(self, linger_ms: int = 0) -> None:
        """Stop the thread (after the commands already submitted) and close the socket and context."""
        if getattr(self, "_thread", None) is None:
            return

        def stop() -> None:
            self._close_linger_ms = linger_ms
            self._stopping = True

        if self._thread.is_alive():
            with self._cond:
                self._commands.append(stop)
            self._wakeup.set()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                logger.error("%s: I/O thread did not stop within 10 s", self._thread.name)
                return
        self._wakeup.close()
        self._context.term()
        self._thread = None

    def _raise_if_failed(self) -> None:
        if getattr(self, "_failure", None) is not None:
            raise TransportError(f"{type(self).__name__} I/O thread failed: {self._failure!r}") from self._failure

    # implemented by the endpoints
    _cond: threading.Condition
    _context: zmq.Context
    _max_frames: int
    _max_incoming_bytes: int

    def _poll_ms(self) -> int:
        return POLL_MS

    def _on_frames(self, frames: list[bytes], problem: str) -> None:
        raise NotImplementedError

    def _on_timer(self, now: float) -> None:
        pass

    def _close_sockets(self) -> None:
        """Close what the I/O thread owns (before the context is terminated, which waits for it)."""
        self._socket.close(linger=self._close_linger_ms)
