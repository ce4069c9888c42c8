"""grpo.decoupled.transport over real ZeroMQ sockets on 127.0.0.1 (random free ports): exactly-once delivery, order,
backpressure, restarts and stale drops (bad messages and lost peers: test_transport_failures.py).

Every wait is bounded; a helper thread that fails reports its exception to the test."""

from __future__ import annotations

import threading

import pytest
from transport_helpers import ANY_PORT, WAIT, Trainer, make_batch, sender, wait_until

from grpo.decoupled.transport import PeerTimeout, RolloutReceiver
from grpo.decoupled.wire import PROTOCOL_VERSION


@pytest.fixture
def receiver():
    with RolloutReceiver(ANY_PORT, queue_size=4) as r:
        yield r


# --- delivery -------------------------------------------------------------------------------------

def test_one_sampler_every_batch_once_in_order_with_weights(receiver):
    receiver.set_policy_version(3)
    with sender(receiver.address, max_inflight=2) as s:
        welcome = s.connect(incarnation=1)
        assert welcome["policy_version"] == 3 and welcome["protocol"] == PROTOCOL_VERSION
        assert welcome["trained_count"] == 0 and welcome["trainer_id"] == receiver.trainer_id
        trainer = Trainer(receiver, 6)
        trainer.start()
        sent = [s.send_batch(make_batch(value=i), {"policy_version": 3, "step": i}) for i in range(6)]
        s.drain(timeout_s=WAIT)
        items = trainer.finish()
        assert sent == [f"s0:1:{i}" for i in range(6)]
        assert [it.batch_id for it in items] == sent
        assert [it.meta["step"] for it in items] == list(range(6))
        assert [float(it.batch.rewards[0]) for it in items] == [float(i) for i in range(6)]
        assert all(it.sampler_id == "s0" and it.policy_version == 3 for it in items)
        assert s.acked == sent and s.inflight == 0 and s.dropped == []
        stats = receiver.stats
        assert (stats["received"], stats["trained"], stats["duplicates"], stats["rejected"]) == (6, 6, 0, 0)
        assert set(receiver.trained_ids) == set(sent)

        receiver.announce_weights(4, "/weights/v4")
        assert s.wait_for_weights(4, timeout_s=WAIT) == (4, "/weights/v4")
        assert receiver.peers()["s0"].incarnation == 1 and receiver.peers()["s0"].batches_received == 6
        assert "weights" in {e.kind for e in s.poll()}


def test_two_samplers(receiver):
    trainer = Trainer(receiver, 8)
    trainer.start()
    results = {}

    def run(sampler_id: str) -> None:
        with sender(receiver.address, sampler_id, max_inflight=2) as s:
            s.connect()
            ids = [s.send_batch(make_batch(), {"policy_version": 0}) for _ in range(4)]
            s.drain(timeout_s=WAIT)
            results[sampler_id] = (ids, list(s.acked))

    threads = [threading.Thread(target=run, args=(f"s{i}",), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    items = trainer.finish()
    for t in threads:
        t.join(timeout=WAIT)
    assert sorted(results) == ["s0", "s1"]
    for sampler_id, (ids, acked) in results.items():
        assert ids == acked
        assert [it.batch_id for it in items if it.sampler_id == sampler_id] == ids  # per-sampler order
    assert len({it.batch_id for it in items}) == 8
    assert receiver.stats["trained"] == 8


def test_backpressure_bounded_queue_nothing_lost():
    with RolloutReceiver(ANY_PORT, queue_size=1) as receiver, sender(receiver.address, max_inflight=3) as s:
        s.connect()
        trainer = Trainer(receiver, 8, delay_s=0.05)
        trainer.start()
        max_inflight = 0
        for _ in range(8):
            s.send_batch(make_batch(), {"policy_version": 0})
            max_inflight = max(max_inflight, s.inflight)
        s.drain(timeout_s=WAIT)
        items = trainer.finish()
        assert max_inflight <= 3
        assert trainer.max_depth <= 1
        assert receiver.stats["busy"] > 0  # refused while the queue was full, resent later
        assert sorted(it.batch_id for it in items) == sorted(s.acked) and len(set(s.acked)) == 8
        assert receiver.stats["trained"] == 8 and receiver.stats["received"] == 8


def test_trainer_restart_acks_trained_batch_without_returning_it():
    first = RolloutReceiver(ANY_PORT, queue_size=4)
    address = first.address
    with sender(address, max_inflight=2) as s:
        s.connect()
        trained = s.send_batch(make_batch(), {"policy_version": 0})
        queued = s.send_batch(make_batch(), {"policy_version": 0})
        item = first.next_batch(timeout_s=WAIT)
        assert item.batch_id == trained
        wait_until(lambda: first.stats["queue_depth"] == 1, "the second batch to queue")
        first.close()  # trained `trained`, crashed before acking anything

        with RolloutReceiver(address, trained_ids={trained: "s0"}) as second:
            # The sampler's next heartbeat gets "hello_required": it says hello and resends both batches.
            assert s.resend_unacked() == 2
            again = second.next_batch(timeout_s=WAIT)
            assert again.batch_id == queued
            second.ack(queued)
            s.drain(timeout_s=WAIT)
            assert s.acked == [trained, queued]
            assert second.next_batch(timeout_s=0.2) is None
            stats = second.stats
            assert stats["received"] == 1 and stats["trained"] == 1 and stats["duplicates"] >= 1
            assert s.welcome["trainer_id"] == second.trainer_id and s.welcome["trained_count"] == 1


def test_provisional_ack_frees_the_slot_and_a_restarted_trainer_trains_the_batch_again():
    # Trained between checkpoints (save_steps > 1): the ack is provisional, so the sampler may send
    # the next batch but keeps this one. The trainer dies before its checkpoint; the restarted one
    # (whose checkpoint does not list the batch) gets it again and trains it: nothing acknowledged is lost.
    first = RolloutReceiver(ANY_PORT, queue_size=4)
    address = first.address
    with sender(address, max_inflight=1) as s:
        s.connect()
        lost = s.send_batch(make_batch(), {"policy_version": 0})
        first.ack(first.next_batch(timeout_s=WAIT).batch_id, durable=False)
        wait_until(lambda: s.inflight == 0, "the provisional ack to free the slot")
        assert s.acked == [] and s.unacked_ids == []
        with pytest.raises(PeerTimeout):
            s.drain(timeout_s=0.3)  # a provisional ack is not the end of the batch
        nxt = s.send_batch(make_batch(value=1.0), {"policy_version": 0})  # did not wait: the slot was free
        first.close()  # crashed before the checkpoint listing `lost`

        with RolloutReceiver(address, trained_ids={}) as second:
            got = [second.next_batch(timeout_s=WAIT).batch_id for _ in range(2)]
            assert sorted(got) == sorted([lost, nxt])
            for batch_id in got:
                second.ack(batch_id, durable=False)
            assert second.confirm_durable() == 2  # the checkpoint is on disk
            s.drain(timeout_s=WAIT)
            assert sorted(s.acked) == sorted([lost, nxt]) and second.stats["trained"] == 2


def test_resend_of_a_provisionally_acked_batch_gets_a_provisional_ack_again(receiver):
    with sender(receiver.address, max_inflight=2) as s:
        s.connect()
        batch_id = s.send_batch(make_batch(), {"policy_version": 0})
        receiver.ack(receiver.next_batch(timeout_s=WAIT).batch_id, durable=False)
        wait_until(lambda: s.inflight == 0, "the provisional ack")
        s._unacked.update(s._trained_not_durable)  # as after a reconnect to the same trainer
        s._trained_not_durable.clear()
        s.resend_unacked()
        # `>=` then `==`: a wait for an exact count would time out unexplained if the count went past it.
        wait_until(lambda: receiver.stats["duplicates"] >= 1, "the duplicate")
        assert receiver.stats["duplicates"] == 1
        wait_until(lambda: s.inflight == 0, "the repeated provisional ack")
        assert s.acked == []  # not durable yet: still kept
        receiver.confirm_durable()
        s.drain(timeout_s=WAIT)
        assert s.acked == [batch_id]


def test_stale_batch_dropped_and_resend_is_dropped_again(receiver):
    receiver.set_policy_version(5)
    with sender(receiver.address) as s:
        s.connect()
        batch_id = s.send_batch(make_batch(), {"policy_version": 1})
        item = receiver.next_batch(timeout_s=WAIT)
        receiver.drop(item.batch_id, "stale: sampled with v1, trainer at v5 (max_staleness 2)")
        wait_until(lambda: s.inflight == 0, "the dropped notice")
        assert s.dropped == [(batch_id, "stale: sampled with v1, trainer at v5 (max_staleness 2)")]
        assert s.acked == [] and receiver.stats["dropped"] == 1
        assert [e.kind for e in s.poll()] == ["welcome", "dropped"]
        with pytest.raises(KeyError, match="already dropped"):
            receiver.ack(batch_id)
        # A resend of a dropped batch (same id) is answered at once and not queued again.
        s.send_batch(make_batch(), {"policy_version": 1, "batch_id": batch_id})
        wait_until(lambda: s.inflight == 0, "the second dropped notice")
        assert receiver.stats["duplicates"] == 1 and receiver.next_batch(timeout_s=0.1) is None


def test_a_host_name_that_resolves_only_to_loopback_is_refused_as_a_bind_address(monkeypatch):
    # /etc/hosts often maps the machine's own name to 127.0.1.1: binding it looks remote but is not
    import socket

    from grpo.decoupled.listen import check_bind_address, hidden_loopback

    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "trainer-host":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        if host == "gpu-node-3":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.3", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert hidden_loopback("trainer-host") == ["127.0.1.1"]
    assert hidden_loopback("gpu-node-3") == hidden_loopback("127.0.0.1") == hidden_loopback("*") == []
    with pytest.raises(ValueError, match=r"'trainer-host' resolves only to loopback \(127.0.1.1\)"):
        check_bind_address("tcp://trainer-host:5555", "token")
    check_bind_address("tcp://gpu-node-3:5555", "token")
    check_bind_address("tcp://0.0.0.0:5555", "token")
    with pytest.raises(ValueError, match="does not resolve"):
        hidden_loopback("no-such-host.invalid")
    pytest.importorskip("fastapi")
    from grpo.config import ConfigError
    from grpo.decoupled.ref_server import make_server

    monkeypatch.setenv("GRPO_TEST_TOKEN", "secret")
    with pytest.raises(ConfigError, match="resolves only to loopback"):  # before any model is loaded
        make_server("/no/such/model", host="trainer-host", token_env="GRPO_TEST_TOKEN")
