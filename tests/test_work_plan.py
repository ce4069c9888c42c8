"""The trainer's work plan (which sampler makes which chunk), alone and over real sockets."""

from __future__ import annotations

import pytest

from grpo.decoupled.work_plan import Assignment, Chunk, WorkPlan, chunk_of

ALIVE = {"a", "b", "c"}


def test_chunk_ids_round_trip_and_refuse_other_ids():
    assert chunk_of(Chunk(12, 3).id) == Chunk(12, 3)
    for other in ("sampler-0:1", "step-1/rank-x", "step-1/rank-1/x", "", "step--1/rank-0"):
        assert chunk_of(other) is None


def test_two_samplers_share_a_step_at_max_staleness_0():
    plan = WorkPlan(ranks=2, max_staleness=0)
    assert plan.want("a", ALIVE) == Assignment(Chunk(1, 0), 0)
    assert plan.want("b", ALIVE) == Assignment(Chunk(1, 1), 0)
    assert plan.want("a", ALIVE) == Assignment(Chunk(1, 0), 0), "asking again gives the chunk it holds"
    assert plan.arrived_from(Chunk(1, 0), "a")
    assert plan.want("a", ALIVE) is None and plan.waiting == ["a"], "step 2 waits for weights of version 1"
    assert plan.arrived_from(Chunk(1, 1), "b") and plan.want("b", ALIVE) is None
    plan.trained(1)
    work = plan.published(1, ALIVE)
    assert work == [("a", Assignment(Chunk(2, 0), 1)), ("b", Assignment(Chunk(2, 1), 1))]
    assert plan.waiting == []


def test_max_staleness_opens_later_steps_with_older_weights():
    plan = WorkPlan(ranks=1, max_staleness=2, trained_steps=4, version=4)
    got = [plan.want(s, ALIVE) for s in ("a", "b", "c")]
    # the oldest weights each may be made from (the sampler takes the newest it has)
    assert got == [Assignment(Chunk(5, 0), 2), Assignment(Chunk(6, 0), 3), Assignment(Chunk(7, 0), 4)]
    assert plan.want("d", ALIVE | {"d"}) is None


def test_a_restarted_or_silent_sampler_frees_its_chunk():
    plan = WorkPlan(ranks=2, max_staleness=0)
    assert plan.want("a", ALIVE).chunk == Chunk(1, 0)
    plan.forget_sampler("a")  # a restart: it makes nothing it was given before
    assert plan.want("b", ALIVE).chunk == Chunk(1, 0)
    assert plan.want("c", ALIVE).chunk == Chunk(1, 1)
    assert plan.want("a", ALIVE) is None
    # b went silent: its chunk goes to the next sampler that asks
    assert plan.want("a", {"a", "c"}).chunk == Chunk(1, 0)


def test_the_first_copy_counts_and_a_stale_chunk_is_made_again():
    plan = WorkPlan(ranks=1, max_staleness=0)
    plan.want("a", ALIVE)
    assert plan.arrived_from(Chunk(1, 0), "b"), "a copy from anyone counts"
    assert not plan.arrived_from(Chunk(1, 0), "a"), "the second copy does not"
    plan.reopen(Chunk(1, 0))
    assert plan.want("a", ALIVE).chunk == Chunk(1, 0)
    plan.trained(1)
    assert not plan.arrived_from(Chunk(1, 0), "a"), "a trained step's chunk is not wanted"
    assert not plan.arrived_from(Chunk(2, 5), "a"), "nor a rank the trainer does not have"


def test_bad_plan_is_refused():
    with pytest.raises(ValueError, match="ranks 0"):
        WorkPlan(ranks=0, max_staleness=0)


def test_reference_plan_hands_every_chunk_once_in_order():
    # A slow plain reference: with samplers asking in turn and every chunk arriving before the trainer
    # trains a step, the chunks handed out are every (step, rank) exactly once, in order.
    plan, handed = WorkPlan(ranks=3, max_staleness=1), []
    for step in range(1, 6):
        for sampler in ("a", "b", "c", "a", "b", "c"):
            assignment = plan.want(sampler, ALIVE)
            if assignment is not None:
                handed.append(assignment.chunk)
                assert assignment.min_version == max(0, assignment.chunk.step - 2)
                plan.arrived_from(assignment.chunk, sampler)
        plan.trained(step)
        plan.published(step, ALIVE)
    assert handed[: 3 * 6] == [Chunk(s, r) for s in range(1, 7) for r in range(3)]
    assert len(set(handed)) == len(handed)


# --- over real sockets ------------------------------------------------------------------------------

def test_samplers_ask_for_chunks_over_sockets_and_a_late_copy_is_dropped():
    from transport_helpers import ANY_PORT, WAIT, make_batch, sender

    from grpo.decoupled.transport import RolloutReceiver

    with RolloutReceiver(ANY_PORT, queue_size=4, work_plan=WorkPlan(ranks=2, max_staleness=0)) as receiver, \
            sender(receiver.address, "a", max_inflight=2) as a, sender(receiver.address, "b", max_inflight=2) as b:
        a.connect(), b.connect()
        work_a, work_b = a.request_work(timeout_s=WAIT), b.request_work(timeout_s=WAIT)
        assert {work_a["batch_id"], work_b["batch_id"]} == {"step-1/rank-0", "step-1/rank-1"}
        assert work_a["min_version"] == work_b["min_version"] == 0
        a.send_batch(make_batch(value=1), {"policy_version": 0, "batch_id": work_a["batch_id"]})
        first = receiver.next_batch(timeout_s=WAIT)
        assert first.batch_id == work_a["batch_id"] and first.sampler_id == "a"
        # b makes a's chunk too (it was handed on, say): the first copy counts, b's is dropped, not left hanging
        b.send_batch(make_batch(value=2), {"policy_version": 0, "batch_id": work_a["batch_id"]})
        b.drain(timeout_s=WAIT)
        assert b.dropped and "came first" in b.dropped[0][1]
        # nothing is open until weights of version 1: the question waits, then is answered by the announcement
        asked = {}
        import threading

        thread = threading.Thread(target=lambda: asked.update(a.request_work(timeout_s=WAIT)))
        thread.start()
        b.send_batch(make_batch(value=3), {"policy_version": 0, "batch_id": work_b["batch_id"]})
        second = receiver.next_batch(timeout_s=WAIT)
        for item in (first, second):
            receiver.ack(item.batch_id)
        receiver.step_trained(1)
        receiver.announce_weights(1, "/weights/v1")
        thread.join(timeout=WAIT)
        assert asked == {"batch_id": "step-2/rank-0", "step": 2, "rank": 0, "min_version": 1, "adopt": []}
        # a batch that is no chunk is refused by a trainer with a work plan
        with pytest.raises(Exception, match="names no chunk"):
            b.send_batch(make_batch(), {"policy_version": 1, "batch_id": "b:0"})
            b.drain(timeout_s=WAIT)
