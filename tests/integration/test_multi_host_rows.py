"""Failure-table rows (docs/guides/reliability.md), each with 2 trainer ranks and every role on its own host (a network namespace,
tests/integration/netns.py): a node that does not see the run folder, two samplers started with one index,
weights pruned while a reader on another host holds them, and a process without the token at the weight
broadcast's port."""

from __future__ import annotations

import sys
import time

import pytest
from netns import hosts
from run_helpers import decoupled_overrides, free_port, logged_steps, train_rows, wait_until
from test_multi_host import fails_within, logged, output, role, torchrun_node

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# The tests' slow reward (a sampler that scores a batch in GRPO_TEST_REWARD_SLEEP_S seconds): the recipe is the
# same for every sampler, their pace set per process.
SLOW = "[{name: 'rewards_for_reliability:letters_slowly'}, {name: answer_correct}]"


def two_rank_overrides(model_dir, out, port: int, trainer_host, **more) -> list[str]:
    """A decoupled run with 2 trainer ranks on ``trainer_host`` (listening on every interface, advertising its
    address, the token required) and one sampler, beta 0; ``more`` adds or replaces keys."""
    return decoupled_overrides(model_dir, out, **{
        "train.mode": "decoupled", "loss.beta": 0.0, "decoupled.num_samplers": 1, "decoupled.trainer_ranks": 2,
        "decoupled.token_env": "GRPO_NS_TOKEN", "decoupled.address": f"tcp://0.0.0.0:{port}",
        "decoupled.advertise_host": trainer_host.address, **more})


def test_a_node_that_does_not_see_the_run_folder_stops_both_nodes_naming_it(tiny_model_dir, tmp_path):
    # Two torchrun nodes as docs/guides/multi-node.md starts them; the second has its own empty folder at the run folder's path
    # (no shared filesystem there). The error names which rank on which host cannot see rank 0's files, and both
    # nodes end within seconds of each other, before any step is trained.
    out = tmp_path / "run"
    out.mkdir()
    args = decoupled_overrides(tiny_model_dir, out, **{"train.max_steps": 2})
    with hosts(2) as (head, other):
        port = free_port()
        nodes = [torchrun_node(head, head, port, "blind", args, tmp_path),
                 torchrun_node(other, head, port, "blind", args, tmp_path, hidden=out)]
        try:
            nodes[0].wait(timeout=300)
            first = time.monotonic()
            nodes[1].wait(timeout=120)
            took = time.monotonic() - first
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    head_log, other_log = (node.log.read_text() for node in nodes)
    assert all(node.returncode != 0 for node in nodes), (head_log[-3000:], other_log[-3000:])
    assert took < 60, f"the second node ended {took:.0f} s after the first"
    # every rank finds it (each reads what every rank saw); the first to fail prints it once, naming the rank and
    # host that cannot see, and the other stops naming that rank and its status
    both = head_log + other_log
    assert both.count("configuration error: train.output_dir:") == 1, both
    assert "rank 1 on " in both and "cannot see the files" in both, both
    assert both.count(" stops: rank ") == 1 and "failed (exit 2" in both, both
    assert not (out / "metrics.jsonl").exists()  # nothing trained


def test_two_samplers_on_two_hosts_with_one_index_the_older_is_refused_within_seconds(tiny_model_dir, tmp_path):
    # The failure table's row, with 2 trainer ranks: sampler 0 started on one host, then again on another (a
    # job resubmitted while the old one still runs). The older scores slowly (10 s a batch) so that it is still
    # at work when the newer says hello; the trainer refuses it then (and again as the run ends), so it stops at
    # its next wait (a batch at most) saying why, even when the newer has trained the run to its end by then.
    port = free_port()
    with hosts(3) as (trainer_host, old_host, new_host):
        out = tmp_path / "run"
        shared = two_rank_overrides(tiny_model_dir, out, port, trainer_host, **{"train.max_steps": 4, "rewards": SLOW})
        trainer = role(trainer_host, "trainer", shared, "t" * 32, tmp_path, ranks=2)
        procs = [trainer]
        try:
            wait_until(lambda: (out / "decoupled" / "trainer_address.json").exists(), "the trainer's address",
                       timeout=300, proc=trainer)
            older = role(old_host, "sampler", [*shared, "decoupled.sampler_index=0"], "t" * 32, tmp_path, "-older",
                         env=("GRPO_TEST_REWARD_SLEEP_S=10",))
            procs.append(older)
            wait_until(lambda: "connected to" in older.log.read_text(), "the older sampler's hello", timeout=300,
                       proc=older)
            newer = role(new_host, "sampler", [*shared, "decoupled.sampler_index=0"], "t" * 32, tmp_path, "-newer")
            procs.append(newer)
            wait_until(lambda: "connected to" in newer.log.read_text(), "the newer sampler's hello", timeout=300,
                       proc=newer)
            assert older.poll() is None, "the older sampler ended before the newer said hello: " + output(older)
            fails_within(older, 60, "two processes run as sampler-0", "give every sampler its own "
                                    "decoupled.sampler_index")
            trainer.wait(timeout=400)
            assert trainer.returncode == 0, output(trainer)
            newer.wait(timeout=120)
            assert newer.returncode == 0, output(newer)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]  # every step trained once


# A reader on a third host: it leases the newest version (as a sampler does before it opens one), writes its
# number, holds the lease until told to read, then loads that version with its checksums verified.
LEASE_HOLDER = """
import sys, time
from pathlib import Path
from grpo.weight_store import LEASES_DIR, WeightStore
from grpo.weight_store.leases import read_lease
out = Path(sys.argv[1])
store = WeightStore(out)
store.wait_for_version(1, timeout_s=300)
while True:
    version = store.latest_version()
    with read_lease(store.dir / LEASES_DIR, version):
        if not store.version_dir(version).exists():
            continue  # pruned before the lease was taken: lease the newest again
        (out / "leased").write_text(str(version))
        while not (out / "read-now").exists():
            time.sleep(0.1)
        loaded = store.load(version)
        print("read version", loaded.version, "with", len(loaded.state_dict), "tensors", file=sys.stderr)
        break
"""


def test_weights_a_reader_on_another_host_holds_outlive_prunes_and_go_after_its_release(tiny_model_dir, tmp_path):
    # The failure table's row "the trainer prunes weights a sampler is reading", with 2 trainer ranks: weights_keep=1
    # prunes every older version at each publish, but not the one a reader on another host holds; the reader
    # then loads it whole, and a publish after its release removes it. Steps take >= 2 s each (a slow reward),
    # so that publishes still come after the release.
    port = free_port()
    with hosts(3) as (trainer_host, sampler_host, reader_host):
        out = tmp_path / "run"
        shared = two_rank_overrides(tiny_model_dir, out, port, trainer_host, **{
            "train.max_steps": 8, "rewards": SLOW, "decoupled.weights_keep": 1})
        trainer = role(trainer_host, "trainer", shared, "t" * 32, tmp_path, ranks=2)
        sampler = role(sampler_host, "sampler", [*shared, "decoupled.sampler_index=0"], "t" * 32, tmp_path,
                       env=("GRPO_TEST_REWARD_SLEEP_S=2",))
        reader = logged(reader_host.command([sys.executable, "-c", LEASE_HOLDER, str(out)]), tmp_path / "reader.log")
        procs = [trainer, sampler, reader]
        try:
            wait_until(lambda: (out / "leased").exists(), "the reader's lease", timeout=300, proc=reader)
            held = int((out / "leased").read_text())
            wait_until(lambda: logged_steps(out) >= held + 3, f"{held + 3} steps", timeout=300, proc=trainer)
            versions = sorted(int(p.name[1:]) for p in (out / "weights").glob("v[0-9]*"))
            assert versions[0] == held and versions[-1] >= held + 2, versions  # the ones between pruned
            (out / "read-now").touch()
            reader.wait(timeout=120)
            assert reader.returncode == 0, output(reader)
            assert f"read version {held} with" in output(reader)
            trainer.wait(timeout=400)
            assert trainer.returncode == 0, output(trainer)
            sampler.wait(timeout=120)
            assert sampler.returncode == 0, output(sampler)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert not (out / "weights" / f"v{held}").exists(), f"version {held} outlived its lease"
    assert [r["step"] for r in train_rows(out)] == list(range(1, 9))


# A process on another host that knows the broadcast port but not the run's token: it reaches the port, tries
# to join as the group's rank 1 and to receive, and says how far it got (exit 3: refused, 0: it got weights).
INTRUDER = """
import socket, sys
from grpo.weight_store.broadcast import WeightBroadcast
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
socket.create_connection((host, port), timeout=10).close()
print("reached the port", file=sys.stderr, flush=True)
try:
    group = WeightBroadcast(host, port, 1, 2, join_timeout_s=5.0, op_timeout_s=5.0, token=token)
except Exception as err:
    print("refused:", type(err).__name__, err, file=sys.stderr)
    sys.exit(3)
print("received", group.receive() is not None, file=sys.stderr)
"""


def test_a_process_on_another_host_without_the_token_gets_no_broadcast_weights(tiny_model_dir, tmp_path):
    # The failure table's row "a process without the token at the weight broadcast's port", with 2 trainer ranks and the
    # intruders on a host of their own: while the group serves the real sampler (another host), one intruder
    # with no token and one with a wrong one reach the port, find no group and receive nothing; the run ends.
    port, weight_port = free_port(), free_port()
    with hosts(3) as (trainer_host, sampler_host, intruder_host):
        out = tmp_path / "run"
        shared = two_rank_overrides(tiny_model_dir, out, port, trainer_host, **{
            "train.max_steps": 10, "rewards": SLOW, "decoupled.weight_sync": "broadcast",
            "decoupled.weight_sync_port": weight_port})
        # gloo picks its interface by the host name, which resolves to loopback here: GLOO_SOCKET_IFNAME, as the
        # docs/guides/multi-node.md says for such machines
        trainer = role(trainer_host, "trainer", shared, "t" * 32, tmp_path, ranks=2,
                       env=(f"GLOO_SOCKET_IFNAME={trainer_host.interface}",))
        sampler = role(sampler_host, "sampler", [*shared, "decoupled.sampler_index=0"], "t" * 32, tmp_path,
                       env=("GRPO_TEST_REWARD_SLEEP_S=3", f"GLOO_SOCKET_IFNAME={sampler_host.interface}"))
        procs = [trainer, sampler]
        try:
            wait_until(lambda: "broadcast to 1 samplers" in trainer.log.read_text(), "a weights broadcast",
                       timeout=200, proc=trainer)
            intruders = [logged(intruder_host.command([sys.executable, "-c", INTRUDER, trainer_host.address,
                                                       str(weight_port), token]), tmp_path / f"intruder{k}.log")
                         for k, token in enumerate(("", "x" * 32))]
            procs += intruders
            for intruder in intruders:
                intruder.wait(timeout=120)
                log = intruder.log.read_text()
                assert intruder.returncode == 3 and "reached the port" in log and "received" not in log, log
            assert trainer.poll() is None, "the run ended before the intruders were done: " + output(trainer)
            trainer.wait(timeout=400)
            assert trainer.returncode == 0, output(trainer)
            sampler.wait(timeout=120)
            assert sampler.returncode == 0, output(sampler)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert "weight broadcast failed" not in trainer.log.read_text()  # the group served the sampler throughout
    assert [r["step"] for r in train_rows(out)] == list(range(1, 11))


def test_a_broadcast_group_that_cannot_form_across_hosts_gives_way_to_files(tiny_model_dir, tmp_path):
    # Host names resolving to loopback and no GLOO_SOCKET_IFNAME: gloo's members try 127.0.0.1. Rank 0's group
    # creation then either fails at once or outlives its own timeout; in the second case rank 0 stops waiting
    # after peer_timeout_s and a margin. Either way it says why and the weights go through files: the run ends,
    # no rank hangs.
    port, weight_port = free_port(), free_port()
    with hosts(2) as (trainer_host, sampler_host):
        out = tmp_path / "run"
        shared = two_rank_overrides(tiny_model_dir, out, port, trainer_host, **{
            "train.max_steps": 3, "decoupled.peer_timeout_s": 30, "decoupled.weight_sync": "broadcast",
            "decoupled.weight_sync_port": weight_port})
        trainer = role(trainer_host, "trainer", shared, "t" * 32, tmp_path, ranks=2)
        sampler = role(sampler_host, "sampler", [*shared, "decoupled.sampler_index=0"], "t" * 32, tmp_path)
        try:
            trainer.wait(timeout=400)  # a hang: until the collectives' 30 min timeout
            sampler.wait(timeout=120)
        finally:
            for proc in (trainer, sampler):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert trainer.returncode == 0 and sampler.returncode == 0, (output(trainer), output(sampler))
    # gloo fails either at once (rank 0 is refused) or not at all (rank 0 waits): both end in the files
    log = trainer.log.read_text()
    assert "weights go through files: " in log and "did not form within" in log, log[-3000:]
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]
