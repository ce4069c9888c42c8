"""grpo.parallel.rank_failure on a real TCPStore in this process: the first failure wins and is the one every
rank exits with; a watching rank ends when another fails, not when it fails itself; a lost store ends it too.
(Real ranks under torchrun and DeepSpeed's launcher: tests/reliability/test_rank_failures.py.)"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist
from transport_helpers import free_port

from grpo.config import ConfigError
from grpo.errors import EXIT_BAD_INPUT, EXIT_FAILED
from grpo.parallel.rank_failure import FailureWatch, failure_status

BOUND_S = 30.0  # a bound against hangs only


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), world_size=None, is_master=True,
                         timeout=datetime.timedelta(seconds=BOUND_S), wait_for_workers=False)


def watch(store, rank: int, exits: list) -> FailureWatch:
    def exit(code):
        exits.append((rank, code))

    return FailureWatch(store, rank, 2, hosts_store=False, exit=exit, poll_s=0.05)


def test_the_first_failure_is_printed_once_and_is_every_ranks_status(store, capsys):
    exits: list = []
    rank_0, rank_1 = watch(store, 0, exits), watch(store, 1, exits)
    first = rank_1.fail(ConfigError("decoupled.address: bad"))
    later = rank_0.fail(RuntimeError("gloo: connection closed by peer"))  # the consequence on the other rank
    assert first == later and (first.rank, first.code) == (1, EXIT_BAD_INPUT)
    err = capsys.readouterr().err
    assert err.count("decoupled.address: bad") == 1 and "rank 1 of 2 on " in err
    assert "connection closed" not in err and "grpo: rank 0 on " in err and "rank 1 on " in err
    assert rank_1.fail(ValueError("again")) is first  # one outcome per rank
    assert exits == []


def test_a_watching_rank_exits_with_the_failed_ranks_status_within_seconds(store):
    exits: list = []
    ended = threading.Event()
    rank_0 = watch(store, 0, exits)
    rank_0._exit = lambda code: (exits.append((0, code)), ended.set())
    rank_0.start()
    rank_1 = watch(store, 1, exits).start()
    rank_1.fail(TimeoutError("no rollout chunk"))
    assert ended.wait(BOUND_S), "the watching rank never noticed"
    assert exits == [(0, EXIT_FAILED)]
    rank_0.stop()
    rank_1.stop()


def test_a_rank_does_not_end_itself_and_a_stopped_watch_ends_nothing(store):
    exits: list = []
    rank_0 = watch(store, 0, exits).start()
    rank_0.stop()  # the clean end: stopped before the last barrier
    rank_1 = watch(store, 1, exits).start()
    rank_1.fail(ValueError("boom"))
    rank_1.stop()
    assert exits == []


def test_a_lost_store_ends_a_watching_rank():
    server = dist.TCPStore("127.0.0.1", free_port(), world_size=None, is_master=True,
                           timeout=datetime.timedelta(seconds=BOUND_S), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, world_size=None, is_master=False,
                           timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
    ended = threading.Event()
    exits: list = []
    rank_1 = FailureWatch(client, 1, 2, hosts_store=False, exit=lambda code: (exits.append(code), ended.set()),
                          poll_s=0.05)
    rank_1.start()
    del server  # rank 0 (or torchrun's node 0) is gone with its store
    assert ended.wait(BOUND_S), "a lost store went unnoticed"
    assert exits == [EXIT_FAILED]


def test_failure_status_of_known_errors_and_of_a_bug():
    assert failure_status(ConfigError("x")) == (EXIT_BAD_INPUT, "grpo: configuration error: x")
    code, text = failure_status(ZeroDivisionError("division by zero"))
    assert code == EXIT_FAILED and "ZeroDivisionError: division by zero" in text  # its traceback is the report
