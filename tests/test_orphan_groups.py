"""A dead sampler's unsent partial-rollout groups (issue 45): the trainer knows what each sampler carries (its chunks'
``carried``), hands the groups of one that restarted or went silent to the next sampler given a chunk (``adopt``),
and trains a group id once even when two samplers made it. End to end: tests/integration/test_partial_rollouts_run.py."""

from __future__ import annotations

import pytest
import torch

from grpo.decoupled.carry_over import CarryOver, group_place
from grpo.decoupled.work_plan import Assignment, Chunk, WorkPlan

ALIVE = {"a", "b", "c"}


def test_a_restarted_samplers_carried_groups_go_to_the_next_sampler_given_a_chunk_once():
    plan = WorkPlan(ranks=1, max_staleness=2)
    assert plan.want("a", ALIVE) == Assignment(Chunk(1, 0), 0)
    assert plan.arrived_from(Chunk(1, 0), "a")
    plan.carries("a", ["step-1/rank-0#1", "step-1/rank-0#3"])
    plan.forget_sampler("a")  # it restarted: its memory, and the groups in it, are gone
    got = plan.want("b", ALIVE)
    assert got == Assignment(Chunk(2, 0), 0, ("step-1/rank-0#1", "step-1/rank-0#3"))
    assert got.header()["adopt"] == ["step-1/rank-0#1", "step-1/rank-0#3"]
    assert plan.want("b", ALIVE) == got, "asking again gives the same chunk with the same groups"
    assert plan.want("c", ALIVE).adopt == (), "an orphan goes to one sampler"
    assert plan.carried["b"] == {"step-1/rank-0#1", "step-1/rank-0#3"}


def test_a_silent_samplers_groups_are_adopted_and_a_chunk_made_before_the_adoption_keeps_them_owed():
    plan = WorkPlan(ranks=1, max_staleness=3)
    plan.want("a", ALIVE), plan.want("b", ALIVE)  # a: step 1, b: step 2
    plan.arrived_from(Chunk(1, 0), "a")
    plan.carries("a", ["step-1/rank-0#0"])
    got = plan.want("b", {"b"})  # b still holds step 2: nothing new is handed to it
    assert got.chunk == Chunk(2, 0) and got.adopt == ()
    got = plan.want("c", {"b", "c"})  # a is silent: its group goes with c's chunk
    assert got == Assignment(Chunk(3, 0), 0, ("step-1/rank-0#0",))
    # c's chunk of before (not in this plan's handouts) arrives late with its old carry: the adopted group stays owed
    plan.carries("c", ["step-0/rank-0#9"])
    assert plan.carried["c"] == {"step-0/rank-0#9", "step-1/rank-0#0"}
    plan.arrived_from(Chunk(3, 0), "c")
    plan.carries("c", [])  # the adopted group finished and was sent in step 3's chunk
    plan.forget_sampler("c")
    assert plan.want("b", ALIVE | {"d"}).adopt == () and plan.want("d", ALIVE | {"d"}).adopt == ()


def test_a_dropped_chunks_groups_are_owed_by_its_sampler_again():
    plan = WorkPlan(ranks=1, max_staleness=1)
    plan.want("a", ALIVE)
    plan.arrived_from(Chunk(1, 0), "a")
    plan.carries("a", [])
    plan.reopen(Chunk(1, 0))  # the trainer dropped it: a starts its groups over...
    plan.owes("a", ["step-1/rank-0#0", "step-0/rank-0#2"])
    plan.forget_sampler("a")  # ...unless it dies first
    assert plan.want("b", ALIVE) == Assignment(Chunk(1, 0), 0, ("step-0/rank-0#2", "step-1/rank-0#0"))


def test_reference_no_carried_group_is_lost_when_samplers_die():
    # A slow plain reference: samplers make chunks in turn, each keeps some groups unsent (its newest chunk's
    # carried list), and now and then one restarts (its memory gone). Every group a sampler holds is one the plan
    # knows it holds (or an orphan), and every group ever started is in the end sent, or held, or known to the plan.
    rng = torch.Generator().manual_seed(0)
    plan, holding, sent, started = WorkPlan(ranks=2, max_staleness=1), {s: set() for s in "abc"}, set(), set()
    restarts = 0
    for step in range(1, 30):
        for sampler in "abc":
            work = plan.want(sampler, ALIVE)
            if work is None:
                continue
            own = {f"{work.chunk.id}#{i}" for i in range(3)}
            started |= own
            pool = sorted(holding[sampler] | set(work.adopt) | own)
            keep = {g for g in pool if torch.rand(1, generator=rng).item() < 0.4}
            sent |= set(pool) - keep
            holding[sampler] = keep
            plan.arrived_from(work.chunk, sampler)
            plan.carries(sampler, sorted(keep))
            if torch.rand(1, generator=rng).item() < 0.2:
                plan.forget_sampler(sampler)
                holding[sampler], restarts = set(), restarts + 1
            held = set().union(*holding.values())
            assert held <= set().union(*plan.carried.values()) | plan.orphans
        plan.trained(step)
        plan.published(step, ALIVE)
    assert restarts > 5 and len(sent) > 50
    # held, or known to the plan: carried by a sampler (one handed it with a chunk it has yet to ask for again)
    known = set().union(*holding.values(), *plan.carried.values()) | plan.orphans
    assert started <= sent | known, "a started group was lost"


def test_group_ids_name_their_chunk_and_place():
    assert group_place("step-3/rank-0#2") == ("step-3/rank-0", 2)
    for bad in ("step-3/rank-0", "step-3/rank-0#x", "#2", ""):
        with pytest.raises(ValueError, match="not a partial-rollout group id"):
            group_place(bad)


def test_an_adopted_group_opens_with_its_prompt_once(tiny_tokenizer):
    from grpo.data.example import Example
    from grpo.data.prompt_sampler import PromptSampler
    from grpo.decoupled.partial_rollouts import PartialInputs, open_groups
    from grpo.rollout.engine import SamplingParams
    from grpo.step.experience import ExperienceSettings

    train_set = [Example(messages=[{"role": "user", "content": f"question {i}"}], answer=str(i), answer_raw=str(i),
                         source=f"t:{i}") for i in range(10)]
    sampler = PromptSampler(len(train_set), prompts_per_step=4, seed=3)
    settings = ExperienceSettings(SamplingParams(n=2, max_tokens=8), None, 512, "grpo", None, 1e-4, False, 8)
    inputs = PartialInputs(tiny_tokenizer, train_set, sampler, [], [], settings, seed=0)
    carry = CarryOver(group_size=2, max_tokens=8, budget=4)
    assert open_groups(carry, inputs, ["step-5/rank-1#1", "step-2/rank-0#0"], world_size=2) == 2
    assert open_groups(carry, inputs, ["step-5/rank-1#1"], world_size=2) == 0, "an open group is not opened twice"
    first = carry.groups[0]
    example = sampler.rank_indices(5, 1, 2)[1]
    assert (first.group_id, first.example_index) == ("step-5/rank-1#1", example)
    assert f"question {example}" in first.prompt and len(first.rows) == 2
    assert first.prompt_ids == tiny_tokenizer(first.prompt, add_special_tokens=False)["input_ids"]
    assert carry.groups[1].example_index == sampler.rank_indices(2, 0, 2)[0]
    with pytest.raises(ValueError, match="has 2 prompts"):
        open_groups(carry, inputs, ["step-5/rank-1#2"], world_size=2)
    with pytest.raises(ValueError, match="names no chunk"):
        open_groups(carry, inputs, ["sampler-0#1"], world_size=2)


def test_a_group_in_two_chunks_of_one_step_is_trained_once():
    # An orphan adopted while its sampler was only silent: both may send it, in chunks of the same step.
    from step_helpers import random_batch

    from grpo.decoupled.carry_over import ALL_GROUPS_TRAINED
    from grpo.decoupled.link_settings import ReceivingSettings
    from grpo.decoupled.trainer_role import step_chunks
    from grpo.decoupled.transport import IncomingBatch

    arrivals = [
        IncomingBatch("step-2/rank-0", "a", 1, random_batch(vocab=50, N=4), {"groups": ["x#0", "x#1"]}, 0.0),
        IncomingBatch("step-2/rank-1", "d", 1, random_batch(vocab=50, N=2), {"groups": ["x#1"]}, 0.0),
        IncomingBatch("step-2/rank-1", "c", 1, random_batch(vocab=50, N=2), {"groups": ["x#0"]}, 0.0),
        IncomingBatch("step-2/rank-1", "b", 1, random_batch(vocab=50, N=4), {"groups": ["x#1", "y#0"]}, 0.0),
    ]

    class Receiver:
        def __init__(self):
            self.dropped = []

        def drop(self, batch_id, reason, final=True):
            self.dropped.append((batch_id, reason))

        def next_batch(self, timeout_s):
            return arrivals.pop(0) if arrivals else None

    settings = ReceivingSettings(trainer_ranks=2, max_staleness=1, peer_timeout_s=60, sync_steps=1, weights_keep=1,
                                 max_message_bytes=1 << 20)
    receiver = Receiver()
    # rank 1's first two copies hold only groups of rank 0's chunk: dropped (made again); the third loses x#1
    chunks, _ = step_chunks(receiver, 2, settings, {}, None, trained_groups=set())
    assert [c.meta["groups"] for c in chunks] == [["x#0", "x#1"], ["y#0"]]
    assert receiver.dropped == [("step-2/rank-1", ALL_GROUPS_TRAINED), ("step-2/rank-1", ALL_GROUPS_TRAINED)]


def test_over_sockets_a_samplers_carried_groups_reach_the_next_sampler_after_it_says_bye():
    from transport_helpers import ANY_PORT, WAIT, make_batch, sender

    from grpo.decoupled.transport import RolloutReceiver

    with RolloutReceiver(ANY_PORT, queue_size=4, work_plan=WorkPlan(ranks=1, max_staleness=1)) as receiver, \
            sender(receiver.address, "b") as b:
        a = sender(receiver.address, "a")
        a.connect()
        assert a.request_work(timeout_s=WAIT)["adopt"] == []
        a.send_batch(make_batch(), {"policy_version": 0, "batch_id": "step-1/rank-0",
                                    "groups": ["step-1/rank-0#0"], "carried": ["step-1/rank-0#1"]})
        first = receiver.next_batch(timeout_s=WAIT)
        assert first.meta["carried"] == ["step-1/rank-0#1"]
        receiver.ack(first.batch_id)
        a.drain(timeout_s=WAIT)
        # a bad list is refused by name, before it reaches the plan
        with pytest.raises(Exception, match="'carried' must be a list of group ids"):
            a.send_batch(make_batch(), {"policy_version": 0, "batch_id": "step-2/rank-0", "carried": "x#1"})
            a.drain(timeout_s=WAIT)
        a.close()  # bye: a's memory, and its unsent group, are gone
        b.connect()
        work = b.request_work(timeout_s=WAIT)
        assert (work["batch_id"], work["adopt"]) == ("step-2/rank-0", ["step-1/rank-0#1"])


SAVED = {"carried": {"a": {"incarnation": 7, "groups": ["step-1/rank-0#1"]}}, "orphans": ["step-1/rank-0#3"]}


@pytest.mark.parametrize("incarnation, adopted", [(7, ["step-1/rank-0#3"]), (8, ["step-1/rank-0#1", "step-1/rank-0#3"])])
def test_a_restarted_trainer_keeps_who_holds_which_group_from_its_checkpoint(incarnation, adopted):
    # a says hello again as the incarnation the checkpoint names: it lived through the trainer's restart and keeps
    # its groups; as another (it restarted too), its groups are orphans. The checkpoint's orphans go either way.
    from transport_helpers import ANY_PORT, WAIT, sender

    from grpo.decoupled.transport import RolloutReceiver

    plan = WorkPlan(ranks=1, max_staleness=1, trained_steps=1, version=1)
    with RolloutReceiver(ANY_PORT, queue_size=4, work_plan=plan, carried_groups=SAVED) as receiver, \
            sender(receiver.address, "a") as a, sender(receiver.address, "b") as b:
        assert receiver.carried_groups == SAVED
        a.connect(incarnation=incarnation)
        b.connect()
        assert b.request_work(timeout_s=WAIT)["adopt"] == adopted
        saved = receiver.carried_groups
    assert saved["orphans"] == [] and saved["carried"]["b"]["groups"] == adopted


def test_a_sampler_of_the_checkpoint_that_never_says_hello_again_loses_its_groups_once_it_counts_as_silent():
    from transport_helpers import ANY_PORT, WAIT, make_batch, sender

    from grpo.decoupled.transport import RolloutReceiver
    from grpo.decoupled.transport.common import LOST_AFTER_S

    plan = WorkPlan(ranks=1, max_staleness=1, trained_steps=1, version=1)
    with RolloutReceiver(ANY_PORT, queue_size=4, work_plan=plan, carried_groups=SAVED) as receiver, \
            sender(receiver.address, "b") as b:
        b.connect()
        assert b.request_work(timeout_s=WAIT)["adopt"] == ["step-1/rank-0#3"], "a may still come back"
        with receiver._cond:  # the time a silent sampler has since the trainer started has passed (no sleep)
            receiver._started_monotonic -= LOST_AFTER_S + 1
        b.send_batch(make_batch(), {"policy_version": 1, "batch_id": "step-2/rank-0", "groups": [], "carried": []})
        receiver.next_batch(timeout_s=WAIT)
        assert b.request_work(timeout_s=WAIT)["adopt"] == ["step-1/rank-0#1"]


@pytest.mark.parametrize("bad", [{"carried": {"a": {"groups": []}}, "orphans": []}, {"carried": []},
                                 {"carried": {"a": {"incarnation": "x", "groups": []}}, "orphans": []}])
def test_a_malformed_checkpoint_entry_is_an_error_naming_its_shape(bad):
    from grpo.decoupled.transport.receiver import restore_carried

    with pytest.raises(ValueError, match="carried_groups must be"):
        restore_carried(WorkPlan(ranks=1, max_staleness=1), bad)
