"""grpo.decoupled.transport over real ZeroMQ sockets on 127.0.0.1: every kind of bad message refused without stopping
the receiver, peers that are gone or never came, timeouts, heartbeats, bind-address policy, argument checks.

Every wait is bounded; a helper thread that fails reports its exception to the test."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest
from transport_helpers import ANY_PORT, WAIT, free_port, make_batch, raw_dealer, sender, wait_until

from grpo.decoupled.transport import (
    PeerClosed,
    PeerTimeout,
    RolloutReceiver,
    RolloutSender,
    TransportError,
    check_bind_address,
)
from grpo.decoupled.wire import PROTOCOL_VERSION, WireError, decode, encode

SEND_ONE_FRAME = """
import sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart([b"", b"h" * int(sys.argv[2]), b""])
time.sleep(0.3)
"""


@pytest.fixture
def receiver():
    with RolloutReceiver(ANY_PORT, queue_size=4) as r:
        yield r


# --- failures -------------------------------------------------------------------------------------

def test_wrong_token_rejected_counted_and_others_served(caplog):
    with RolloutReceiver(ANY_PORT, token="right") as receiver:
        bad = sender(receiver.address, "intruder", token="wrong", timeout_s=0.8)
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="no trainer at .* its last message was refused: token mismatch"):
            bad.connect()
        assert time.monotonic() - start < 3.0
        assert receiver.stats["rejected"] >= 1 and "intruder" not in receiver.peers()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "from intruder" in r.message]
        assert len(warnings) == 1 and "token mismatch" in warnings[0].message  # once per peer, with the reason

        with sender(receiver.address, "good", token="right") as good:
            good.connect()
            good.send_batch(make_batch(), {"policy_version": 0})
            assert receiver.next_batch(timeout_s=WAIT).sampler_id == "good"


def test_oversized_messages_rejected_and_receiver_keeps_serving():
    limit = 64 * 1024
    with RolloutReceiver(ANY_PORT, max_message_bytes=limit) as receiver:
        with sender(receiver.address, max_message_bytes=1 << 22) as s:
            s.connect()
            # The sender learns the trainer's limit from welcome and refuses locally.
            with pytest.raises(WireError, match=f"over the limit of {limit} bytes"):
                s.send_batch(make_batch(N=8, Lc=2000), {"policy_version": 0})
            assert s.inflight == 0

        with raw_dealer(receiver.address, b"raw") as raw:
            # Frames each under ZeroMQ's per-frame limit but too large together: our check refuses it.
            raw.send_multipart([b"", b"x" * 30_000, b"y" * 30_000, b"z" * 30_000])
            reply = decode(raw.recv_multipart(), max_bytes=limit)
            assert reply.kind == "error" and "exceeds" in reply.header["reason"]
            assert receiver.stats["rejected"] == 1
        # A single frame over MAXMSGSIZE: ZeroMQ itself drops the connection and nothing reaches us. Sent
        # from another process: libzmq 4.3.5 can abort the *sending* process when its multipart message
        # is cut off (session_base.cpp:233), which is why RolloutSender never sends more than the limit.
        subprocess.run([sys.executable, "-c", SEND_ONE_FRAME, receiver.address, str(limit + 1)],
                       timeout=WAIT, capture_output=True, check=False)
        assert receiver.stats["rejected"] == 1

        with sender(receiver.address, "after") as s:
            s.connect()
            s.send_batch(make_batch(), {"policy_version": 0})
            assert receiver.next_batch(timeout_s=WAIT).sampler_id == "after"


def test_restarted_trainer_with_a_smaller_limit_refuses_resends():
    first = RolloutReceiver(ANY_PORT, max_message_bytes=1 << 20)
    with sender(first.address) as s:
        s.connect()
        batch_id = s.send_batch(make_batch(N=8, Lc=2000), {"policy_version": 0})
        assert first.next_batch(timeout_s=WAIT).batch_id == batch_id
        first.close()
        with RolloutReceiver(first.address, max_message_bytes=64 * 1024) as second:
            with pytest.raises(TransportError, match=f"cannot resend batch {batch_id}.*limit of 65536 bytes"):
                s.drain(timeout_s=WAIT)
            assert [b for b, _ in s.rejected] == [batch_id] and s.inflight == 0
            assert second.stats["rejected"] == 0


def test_wrong_protocol_version_rejected(receiver):
    with raw_dealer(receiver.address, b"old") as raw:
        raw.send_multipart([b"", json.dumps({"v": PROTOCOL_VERSION + 1, "kind": "hello", "sampler_id": "old",
                                             "incarnation": 0}).encode(), b""])
        reply = decode(raw.recv_multipart(), max_bytes=1 << 20)
        assert reply.kind == "error" and reply.header["code"] == "bad_message"
        assert f"sampler 'old' speaks protocol version {PROTOCOL_VERSION + 1}, not" in reply.header["reason"]
    assert receiver.stats["rejected"] == 1 and receiver.peers() == {}


def test_garbage_frames_never_crash_the_receiver(receiver, caplog):
    garbage = [[b""], [b"\x00\xff" * 100], [b"x"] * 50, [b"", b"{", b""], [b"", b"[]", b""],
               [b"", b'{"v": 1, "kind": "batch"}', b""], [b"", b'{"v": 1, "kind": "ack", "batch_id": "b", "policy_version": 0}', b""],
               [b"", encode("batch", {"batch_id": "b", "sampler_id": "junk", "policy_version": 0, "completions": [],
                                      "prompts": [], "reward_names": [], "columns": {}, "meta": {}})[1],
                b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}"]]
    with raw_dealer(receiver.address, b"junk") as raw, raw_dealer(receiver.address) as anonymous:
        for frames in garbage:
            raw.send_multipart(frames)
            anonymous.send_multipart(frames)
        wait_until(lambda: receiver.stats["rejected"] >= 2 * len(garbage), "every garbage message to be counted")
        assert receiver.stats["rejected"] == 2 * len(garbage), "a garbage message was counted twice"
        replies = [decode(raw.recv_multipart(), max_bytes=1 << 20) for _ in garbage]
        assert all(r.kind == "error" for r in replies)
        # A well-formed message from a peer that never said hello is answered with hello_required, not queued.
        raw.send_multipart(encode("heartbeat", {"time": 0.0}))
        assert decode(raw.recv_multipart(), max_bytes=1 << 20).header["code"] == "hello_required"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "from junk" in r.message]
    assert len(warnings) == 1  # the first rejection per peer at WARNING, the rest at DEBUG
    with sender(receiver.address) as s:
        s.connect()
        s.send_batch(make_batch(), {"policy_version": 0})
        assert receiver.next_batch(timeout_s=WAIT) is not None
    assert receiver.stats["received"] == 1


def test_hello_must_match_the_routing_id(receiver):
    with raw_dealer(receiver.address, b"alice") as raw:
        raw.send_multipart(encode("hello", {"sampler_id": "bob", "incarnation": 0}))
        reply = decode(raw.recv_multipart(), max_bytes=1 << 20)
        assert reply.header["code"] == "wrong_sampler" and receiver.peers() == {}


def test_no_receiver_peer_timeout_within_the_timeout(caplog):
    address = f"tcp://127.0.0.1:{free_port()}"
    s = sender(address, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match=f"no trainer at {address} after 1.0 s"):
        s.connect()
    assert 1.0 <= time.monotonic() - start < 3.0
    assert any("waiting for trainer at" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(TransportError, match="RolloutSender is closed"):
        s.send_batch(make_batch(), {"policy_version": 0})
    with pytest.raises(RuntimeError, match="call connect"):
        sender(address).send_batch(make_batch(), {"policy_version": 0})


def test_sampler_started_before_the_trainer():
    address = f"tcp://127.0.0.1:{free_port()}"
    with sender(address, timeout_s=0.5) as s:
        result = {}
        thread = threading.Thread(target=lambda: result.update(s.connect(timeout_s=WAIT)), daemon=True)
        thread.start()
        time.sleep(0.7)  # longer than the sender's own timeout_s: connect has its own
        with RolloutReceiver(address) as receiver:
            thread.join(timeout=WAIT)
            assert result["trainer_id"] == receiver.trainer_id


def test_waits_log_status_and_time_out(receiver, caplog):
    with sender(receiver.address, timeout_s=0.6) as s:
        s.connect()
        # The trainer is alive (it answers heartbeats) but never publishes: status lines, then our deadline.
        with pytest.raises(PeerTimeout, match="gave up after 1.0 s"):
            s.wait_for_weights(1, timeout_s=1.0)
        assert any("waiting for trainer at" in r.message and "weights version >= 1" in r.message
                   for r in caplog.records if r.levelno == logging.WARNING)
        s.send_batch(make_batch(), {"policy_version": 0})
        receiver.close()  # the trainer dies: silence, then PeerTimeout (never a silent hang)
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="silent for"):
            s.drain()
        assert time.monotonic() - start < 3.0


def test_trainer_bye_ends_waits(receiver):
    with sender(receiver.address) as s, sender(receiver.address, "poller") as p:
        s.connect()
        p.connect()
        receiver.close(bye_reason="training finished")
        with pytest.raises(PeerClosed, match="training finished"):
            s.wait_for_weights(1, timeout_s=WAIT)
        # A loop of polls sees the bye event, then PeerClosed: it cannot spin on a finished trainer.
        events = []
        with pytest.raises(PeerClosed, match="training finished"):
            for _ in range(100):
                events += p.poll(timeout_s=0.1)
        assert [e.kind for e in events] == ["welcome", "bye"]


def test_poll_loop_ends_when_the_trainer_is_gone():
    receiver = RolloutReceiver(ANY_PORT)
    with sender(receiver.address, timeout_s=0.5) as s:
        s.connect()
        receiver.close()
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="silent for"):
            for _ in range(100):
                s.poll(timeout_s=0.1)
        assert time.monotonic() - start < 2.0


def test_heartbeats_bye_and_disconnected_peers(receiver, caplog):
    with sender(receiver.address, "beating", heartbeat_s=0.05) as s:
        s.connect()
        time.sleep(0.3)
        assert receiver.peers()["beating"].seconds_since_seen < 0.25
        assert receiver.lost_peers(1.0) == []
    wait_until(lambda: "beating" not in receiver.peers(), "the sampler's bye")

    quiet = sender(receiver.address, "quiet")
    quiet.connect()
    quiet.close(bye=False)  # vanishes without a word
    time.sleep(0.3)
    assert receiver.lost_peers(0.2) == ["quiet"]
    # ROUTER_MANDATORY: sending to it fails; the receiver logs it and forgets the peer.
    receiver.announce_weights(1, "/w/1")
    wait_until(lambda: receiver.peers() == {}, "the gone peer to be forgotten")
    assert receiver.stats["send_failed"] == 1
    assert any("disconnected" in r.message for r in caplog.records)


def test_bind_address_policy():
    check_bind_address("tcp://127.0.0.1:5555", "")
    check_bind_address("ipc:///tmp/grpo.sock", "")
    check_bind_address("tcp://0.0.0.0:5555", "a-token")  # allowed with a token (not bound in this test)
    with pytest.raises(ValueError, match="set a shared token"):
        check_bind_address("tcp://0.0.0.0:5555", "")
    with pytest.raises(ValueError, match="set a shared token"):
        check_bind_address("tcp://*:5555", "")
    with pytest.raises(ValueError, match="must look like"):
        check_bind_address("127.0.0.1:5555", "")
    with pytest.raises(ValueError, match="set a shared token"):
        RolloutReceiver("tcp://0.0.0.0:5555")


def test_busy_address_and_closed_receiver(receiver):
    with pytest.raises(TransportError, match=f"cannot listen on {receiver.address}"):
        RolloutReceiver(receiver.address)
    closed = RolloutReceiver(ANY_PORT)
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(TransportError, match="RolloutReceiver is closed"):
        closed.next_batch(timeout_s=0.1)
    with pytest.raises(TransportError, match="RolloutReceiver is closed"):
        closed.announce_weights(1, "/w")


def test_argument_checks(receiver):
    with pytest.raises(ValueError, match="sampler_id"):
        RolloutSender(receiver.address, "")
    with pytest.raises(ValueError, match="max_inflight"):
        RolloutSender(receiver.address, "s", max_inflight=0)
    with pytest.raises(ValueError, match="queue_size"):
        RolloutReceiver(ANY_PORT, queue_size=0)
    with pytest.raises(KeyError, match="never received"):
        receiver.ack("nope")
    with pytest.raises(TypeError, match="policy version is an int"):
        receiver.set_policy_version(1.5)
    with pytest.raises(WireError, match="'path' must be str"):
        receiver.announce_weights(2, None)
    assert receiver.policy_version == 0  # nothing changed by the refused call
    with sender(receiver.address) as s:
        s.connect()
        with pytest.raises(ValueError, match="sampler_id"):
            s.send_batch(make_batch(), {"policy_version": 0, "sampler_id": "other"})
        with pytest.raises(WireError, match="policy_version"):
            s.send_batch(make_batch(), {})


def test_a_sampler_on_another_config_is_refused_at_once_naming_both_hashes():
    import time

    from grpo.config import load_config
    from grpo.decoupled.link_settings import config_fingerprint
    from grpo.decoupled.transport import TransportError

    trainer_cfg = load_config(None, ["train.mode=decoupled"])
    same = load_config(None, ["train.mode=decoupled", "decoupled.sampler_index=1", "decoupled.sampler_device=cpu"])
    other = load_config(None, ["train.mode=decoupled", "rollout.temperature=0.7"])
    assert config_fingerprint(same) == config_fingerprint(trainer_cfg) != config_fingerprint(other)
    with RolloutReceiver(ANY_PORT, config_hash=config_fingerprint(trainer_cfg)) as receiver:
        with sender(receiver.address, "s1", config_hash=config_fingerprint(same)) as ok:
            ok.connect(timeout_s=WAIT)
        started = time.monotonic()
        with sender(receiver.address, "s2", config_hash=config_fingerprint(other)) as wrong:
            with pytest.raises(TransportError, match=r"refused sampler s2: sampler s2 runs another config \(hash "
                                                     + config_fingerprint(other)[:12]):
                wrong.connect(timeout_s=WAIT)
        assert time.monotonic() - started < 5  # at once, not after peer_timeout_s
        assert "s2" not in receiver.peers() and receiver.stats["rejected"] >= 1


def test_two_samplers_with_one_index_are_detected_and_the_older_is_refused():
    import time

    from grpo.decoupled.transport import TransportError

    with RolloutReceiver(ANY_PORT) as receiver:
        with sender(receiver.address, "sampler-1") as first, sender(receiver.address, "sampler-1") as second:
            first.connect(incarnation=11, timeout_s=WAIT)
            second.connect(incarnation=22, timeout_s=WAIT)  # another host started with the same index
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"two processes run as sampler-1: incarnation 11 is still "
                                                     r"running after incarnation 22 \(host .*\) said hello; give "
                                                     r"every sampler its own decoupled.sampler_index"):
                first.request_work(timeout_s=WAIT)  # refused when the newer said hello, and at its every word
            assert time.monotonic() - started < 5  # within seconds (heartbeats), not after a peer timeout
            assert receiver.peers()["sampler-1"].incarnation == 22
            second.poll(timeout_s=0.5)  # the one that said hello last carries on
            assert not [e for e in second.poll() if e.kind == "error"]


def test_an_older_sampler_refused_as_the_run_ends_stops_with_the_duplicate_message_not_a_timeout():
    # The run ends right after the newer's hello, long before the older's next heartbeat (30 s): the trainer
    # must tell the older itself, or it would wait out its 60 s peer timeout and end with a timeout.
    with RolloutReceiver(ANY_PORT) as receiver:
        with (sender(receiver.address, "sampler-1", heartbeat_s=30.0, timeout_s=60.0) as older,
              sender(receiver.address, "sampler-1") as newer):
            older.connect(incarnation=11, timeout_s=WAIT)
            newer.connect(incarnation=22, timeout_s=WAIT)
            receiver.close(bye_reason="the run finished")
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"refused sampler sampler-1: two processes run as sampler-1: "
                                                     r"incarnation 11 is still running after incarnation 22"):
                older.request_work(timeout_s=20)  # without the refusal: "gave up after 20.0 s"
            assert time.monotonic() - started < 15  # generous: it is there at once, the peer timeout is 60 s
            with pytest.raises(PeerClosed, match="the run finished"):
                newer.request_work(timeout_s=WAIT)  # the newer got the run's ordinary bye


def test_the_trainer_refuses_a_replaced_process_when_replaced_and_again_as_the_run_ends():
    # At its replacement, at its every later word (a hello still in flight too: it must not oust the newer), and
    # at the end of the run in case the first was lost: a bye would tell it that the run finished, not to stop.
    receiver = RolloutReceiver(ANY_PORT)
    hello = encode("hello", {"sampler_id": "sampler-1", "incarnation": 11})
    try:
        with raw_dealer(receiver.address, b"sampler-1#11") as older, sender(receiver.address, "sampler-1") as newer:
            older.send_multipart(hello)
            assert decode(older.recv_multipart(), max_bytes=1 << 20).kind == "welcome"
            newer.connect(incarnation=22, timeout_s=WAIT)
            older.send_multipart(hello)
            replies = [decode(older.recv_multipart(), max_bytes=1 << 20) for _ in range(2)]
            assert receiver.peers()["sampler-1"].incarnation == 22
            receiver.close(bye_reason="the run finished")
            replies.append(decode(older.recv_multipart(), max_bytes=1 << 20))
        assert [(r.kind, r.header["code"]) for r in replies] == [("error", "duplicate_sampler")] * 3
        assert all("incarnation 11 is still running after incarnation 22" in r.header["reason"] for r in replies)
    finally:
        receiver.close()
