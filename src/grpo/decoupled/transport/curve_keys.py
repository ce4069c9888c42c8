"""CURVE encryption of the rollout link: the trainer's key pair on the run folder, and the socket options.

The trainer (rank 0) keeps one long-lived server key pair in a folder of the shared run folder:
``server.key_secret`` (mode 0600) and ``server.key`` (public), both in ZeroMQ's Z85 text form. A resumed
trainer reuses the pair, so samplers that read the public key keep working. Samplers use a fresh client
key pair each time they connect; CURVE then encrypts every frame. It does not tell samplers apart (no
ZAP handler: any client knowing the public key may connect): the shared token still authenticates them.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import zmq

from grpo.decoupled.transport.common import PeerTimeout, TransportError

PUBLIC_KEY_FILE = "server.key"
SECRET_KEY_FILE = "server.key_secret"
Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85


def server_secret_key(folder: str | os.PathLike) -> bytes:
    """The trainer's secret key from ``folder``, after making the pair there when the folder has none.

    The secret file is created with mode 0600 from the start (never readable by others, even briefly);
    the public file is written next, atomically, so a sampler waiting for it never reads half a key.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    secret_path = folder / SECRET_KEY_FILE
    if not secret_path.exists():
        try:
            _write_new_secret(secret_path, zmq.curve_keypair()[1])
        except FileExistsError:
            pass  # made meanwhile by another process: use that one
    secret = _read_key(secret_path)
    _check_private(secret_path)
    _publish_public_key(folder / PUBLIC_KEY_FILE, zmq.curve_public(secret))
    return secret


def read_server_key(folder: str | os.PathLike, timeout_s: float, poll_s: float = 0.2) -> bytes:
    """The trainer's public key from ``folder``, waiting up to ``timeout_s`` for it to appear (a sampler
    may start before the trainer); PeerTimeout when it does not."""
    path = Path(folder) / PUBLIC_KEY_FILE
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise PeerTimeout(f"no CURVE server key at {path} after {timeout_s:.0f} s: the trainer writes it when "
                              "it starts with decoupled.encrypt: true (is it running, on this run folder?)")
        time.sleep(poll_s)
    return _read_key(path)


def make_curve_server(socket: zmq.Socket, secret_key: bytes) -> None:
    """Make ``socket`` (before it binds) accept CURVE clients only, with the trainer's secret key."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)


def make_curve_client(socket: zmq.Socket, server_key: bytes) -> None:
    """Make ``socket`` (before it connects) encrypt to the server holding ``server_key``, with an
    ephemeral client key pair (the token, not the client key, says who a sampler is)."""
    public, secret = zmq.curve_keypair()
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _write_new_secret(path: Path, secret: bytes) -> None:
    """Create ``path`` with mode 0600 (FileExistsError when it exists) and write the key into it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
        f.flush()
        os.fsync(f.fileno())


def _publish_public_key(path: Path, public: bytes) -> None:
    """Write the public key unless the file already holds it; refuse one that belongs to another pair."""
    if path.exists():
        if _read_key(path) != public:
            raise TransportError(f"{path} does not hold the public key of {path.with_name(SECRET_KEY_FILE)}: "
                                 "remove both files to make a new pair (samplers then need to restart)")
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(public + b"\n")
    os.replace(temporary, path)


def _read_key(path: Path) -> bytes:
    key = path.read_bytes().strip()
    if len(key) != Z85_KEY_CHARS:
        raise TransportError(f"{path} does not hold a CURVE key ({Z85_KEY_CHARS} Z85 characters), "
                             f"it holds {len(key)} bytes")
    return key


def _check_private(path: Path) -> None:
    """Refuse a secret key others can read (as ssh does): they could decrypt the link."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise TransportError(f"{path} has mode {mode:04o}, readable by others: chmod 600 it, or remove it and "
                             f"{PUBLIC_KEY_FILE} to make a new pair")


# What a sender's socket monitor reports: ZeroMQ retries a failed handshake without a word to the caller.
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A connection closed mid-handshake (NO_DETAIL) is also what a trainer dying at that moment looks like;
# a CURVE server refusing a client's key looks the same, again at every reconnect (about 0.1 s apart).
CLOSED_HANDSHAKES_TO_FAIL = 3


def handshake_failure(event: int, value: int, address: str, encrypting: bool, server_key_file: str = "") -> str:
    """Why a sampler's handshake with the trainer at ``address`` failed, and what to change.

    ``event``/``value``: the monitor's event and its value (a protocol error code, or errno);
    ``encrypting``: whether the sampler uses CURVE; ``server_key_file``: where it read the trainer's key.
    """
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    closed = event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    # A trainer that sees the mismatch first may close before the sampler does: then the sampler sees `closed`.
    detail = "" if mismatch else (
        f" (the trainer closed the connection {CLOSED_HANDSHAKES_TO_FAIL} times in a row)" if closed
        else f" ({zmq.Event(event).name}, code {value:#x})")
    same = "every role needs the same decoupled.encrypt"
    if not encrypting and (mismatch or closed):
        return (f"handshake with {address} failed{detail}: the trainer there encrypts the link (decoupled.encrypt: "
                f"true) and this sampler does not; {same}")
    if not encrypting:
        return f"handshake with {address} failed{detail}: is a grpo trainer listening there? ({same})"
    if mismatch:
        return (f"handshake with {address} failed: this sampler encrypts the link (decoupled.encrypt: true) and "
                f"the trainer there does not; {same}")
    origin = f" (read from {server_key_file})" if server_key_file else ""
    return (f"CURVE handshake with {address} failed{detail}: this sampler's server key{origin} is not the "
            "trainer's (a trainer on another run folder or decoupled.curve_dir, or a key pair made since this "
            f"sampler read it: restart the sampler), or the trainer there does not encrypt ({same})")
