"""CURVE encryption of the rollout link (decoupled.encrypt): a batch crosses encrypted, its text never
appears on the wire, a sampler on the wrong key or without encryption fails within seconds with the reason,
and the trainer's key pair is private and kept across starts.

Real ZeroMQ sockets on 127.0.0.1; a TCP proxy between sender and receiver records the bytes they exchange."""

from __future__ import annotations

import os
import select
import socket
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest
import zmq
from transport_helpers import ANY_PORT, WAIT, Trainer, make_batch, sender

from grpo.config import ConfigError, load_config
from grpo.decoupled.link_settings import sampler_curve_key, trainer_curve_key
from grpo.decoupled.transport import PeerTimeout, RolloutReceiver, TransportError
from grpo.decoupled.transport.curve_keys import (
    PUBLIC_KEY_FILE,
    SECRET_KEY_FILE,
    read_server_key,
    server_secret_key,
)

MARKER = "CURVE-TEST-MARKER-the-prompt-text"
FAST = 3.0  # a refused handshake is reported within this (the sender's peer timeout is far longer)


class RecordingProxy(threading.Thread):
    """Forwards TCP connections from its own port to ``target_port`` and records every byte either way."""

    def __init__(self, target_port: int):
        super().__init__(daemon=True)
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self.stopping = False

    def run(self) -> None:
        peers: dict[socket.socket, socket.socket] = {}
        while not self.stopping:
            readable, _, _ = select.select([self.listener, *peers], [], [], 0.05)
            for sock in readable:
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(("127.0.0.1", self.target_port))
                    peers[client], peers[upstream] = upstream, client
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    other = peers.pop(sock)
                    peers.pop(other, None)
                    sock.close()
                    other.close()
                    continue
                self.captured += data
                peers[sock].sendall(data)
        for sock in [self.listener, *peers]:
            sock.close()

    def stop(self) -> bytes:
        self.stopping = True
        self.join(timeout=WAIT)
        return bytes(self.captured)


def marked_batch():
    batch = make_batch()
    generation = replace(batch.generation, completions=[f"{MARKER} completion {i}" for i in range(4)])
    return replace(batch, generation=generation, prompts=[f"{MARKER} prompt {i}" for i in range(2)])


@contextmanager
def trainer_link(curve_secret_key: bytes | None):
    with RolloutReceiver(ANY_PORT, queue_size=2, curve_secret_key=curve_secret_key) as receiver:
        yield receiver


def exchange_through_proxy(server_key: bytes | None, secret_key: bytes | None) -> tuple[bytes, object]:
    """One batch from a sender to a receiver through the recording proxy: (the bytes seen, the batch received)."""
    with trainer_link(secret_key) as receiver:
        proxy = RecordingProxy(int(receiver.address.rsplit(":", 1)[1]))
        proxy.start()
        trainer = Trainer(receiver, 1)
        trainer.start()
        with sender(proxy.address, curve_server_key=server_key) as s:
            s.connect()
            s.send_batch(marked_batch(), {"policy_version": 0})
            s.drain(timeout_s=WAIT)
        (item,) = trainer.finish()
        return proxy.stop(), item


def test_encrypted_link_delivers_the_batch_and_its_text_never_crosses_in_clear(tmp_path):
    secret = server_secret_key(tmp_path)
    public = read_server_key(tmp_path, timeout_s=0)
    plain_bytes, _ = exchange_through_proxy(None, None)
    assert MARKER.encode() in plain_bytes  # the proxy does see the text of a plaintext batch

    encrypted_bytes, item = exchange_through_proxy(public, secret)
    assert item.batch.prompts == marked_batch().prompts
    assert item.batch.generation.completions == marked_batch().generation.completions
    assert len(encrypted_bytes) > 1000  # the batch did cross this proxy
    assert MARKER.encode() not in encrypted_bytes and b"completion" not in encrypted_bytes
    assert b"CURVE" in encrypted_bytes[:200]  # ZeroMQ's greeting names the mechanism


@pytest.mark.parametrize("sampler_encrypts", [False, True], ids=["plain-sampler", "plain-trainer"])
def test_one_side_encrypting_fails_fast_and_says_which(tmp_path, sampler_encrypts):
    secret = server_secret_key(tmp_path)
    public = read_server_key(tmp_path, timeout_s=0)
    with trainer_link(None if sampler_encrypts else secret) as receiver:
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            sender(receiver.address, timeout_s=60.0, curve_server_key=public if sampler_encrypts else None).connect()
    assert time.monotonic() - started < FAST
    assert not isinstance(info.value, PeerTimeout)
    # The side that sees the mismatch first may close the connection before the other sees why: the message
    # then names the likely cause as well.
    why = "the trainer there does not" if sampler_encrypts else "the trainer there encrypts the link"
    assert f"handshake with {receiver.address} failed" in str(info.value) and why in str(info.value)
    assert "decoupled.encrypt" in str(info.value)


def test_a_wrong_server_key_fails_fast_naming_the_key_file(tmp_path):
    secret = server_secret_key(tmp_path / "trainer")
    wrong = zmq.curve_public(server_secret_key(tmp_path / "another-run"))
    with trainer_link(secret) as receiver:
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            sender(receiver.address, timeout_s=60.0, curve_server_key=wrong,
                   curve_key_file="/run/decoupled/curve/server.key").connect()
    assert time.monotonic() - started < FAST
    assert f"CURVE handshake with {receiver.address} failed" in str(info.value)
    assert "server key (read from /run/decoupled/curve/server.key) is not the trainer's" in str(info.value)


def test_the_secret_key_is_private_from_the_start_and_kept_across_starts(tmp_path):
    first = server_secret_key(tmp_path)
    secret_file, public_file = tmp_path / SECRET_KEY_FILE, tmp_path / PUBLIC_KEY_FILE
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    public = public_file.read_bytes()
    assert server_secret_key(tmp_path) == first  # a second start (a resume) keeps the pair
    assert public_file.read_bytes() == public and public.strip() == zmq.curve_public(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([SECRET_KEY_FILE, PUBLIC_KEY_FILE])  # no temporary


def test_a_secret_key_others_can_read_or_a_foreign_public_key_is_refused(tmp_path):
    server_secret_key(tmp_path)
    os.chmod(tmp_path / SECRET_KEY_FILE, 0o644)
    with pytest.raises(TransportError, match="mode 0644, readable by others"):
        server_secret_key(tmp_path)
    os.chmod(tmp_path / SECRET_KEY_FILE, 0o600)
    (tmp_path / PUBLIC_KEY_FILE).write_bytes(zmq.curve_keypair()[0] + b"\n")
    with pytest.raises(TransportError, match="does not hold the public key of"):
        server_secret_key(tmp_path)


def test_a_sampler_waits_for_the_trainers_key_then_gives_up_with_the_path(tmp_path):
    writer = threading.Timer(0.3, server_secret_key, args=(tmp_path,))
    writer.start()
    assert read_server_key(tmp_path, timeout_s=WAIT, poll_s=0.05) == zmq.curve_public(
        (tmp_path / SECRET_KEY_FILE).read_bytes().strip())
    writer.join()
    with pytest.raises(PeerTimeout, match=f"no CURVE server key at {tmp_path / 'none' / PUBLIC_KEY_FILE}"):
        read_server_key(tmp_path / "none", timeout_s=0.1, poll_s=0.05)


def test_roles_find_the_pair_in_the_run_folder_and_plaintext_needs_no_keys(tmp_path):
    cfg = load_config(None, ["train.mode=decoupled", "decoupled.encrypt=true", f"train.output_dir={tmp_path}"])
    secret = trainer_curve_key(cfg)
    key, key_file = sampler_curve_key(cfg)
    assert key == zmq.curve_public(secret)
    assert key_file == str(tmp_path / "decoupled" / "curve" / PUBLIC_KEY_FILE)
    plain = load_config(None, [f"train.output_dir={tmp_path / 'plain'}"])
    assert trainer_curve_key(plain) is None and sampler_curve_key(plain) == (None, "")
    assert not (tmp_path / "plain").exists()


def test_encrypt_needs_curve_in_libzmq(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="decoupled.encrypt needs CURVE, which this libzmq"):
        load_config(None, ["decoupled.encrypt=true"])
    load_config(None, ["decoupled.encrypt=false"])  # plaintext does not ask
