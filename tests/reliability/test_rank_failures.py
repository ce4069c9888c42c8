"""One rule for a failure on N ranks (grpo.parallel.rank_failure), with real launchers and two ranks: the failure
of one rank reaches the other within seconds, every rank stops, and the first error is printed once, naming its
rank and host. Before, an error on rank 0 of the decoupled trainer left rank 1 waiting in the step's broadcast
(and rank 0 in shutdown's barrier) for the collective timeout, printing nothing.

The wall-clock bounds are generous (a hang would last 30 minutes); each run loads the tiny model on 2 ranks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import run_args
from run_helpers import cli_env, free_port, start, stop_all, train_rows

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]


def torchrun(role: str, *args, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "grpo", role, *map(str, args)]


def deepspeed_runner(hostfile: Path, *args) -> list[str]:
    """DeepSpeed's own launcher as a user runs it on one node of a hostfile (``deepspeed --hostfile H --no_ssh
    --node_rank 0 --module grpo ...``), which starts ``python -u -m grpo --local_rank=N ...`` per slot."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
            "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--module", "grpo",
            *map(str, args)]


def ends_within(cmd: list[str], seconds: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` to its end (killed after ``seconds`` + 60); returns (status, stderr + stdout, seconds taken)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds + 60)
    finally:
        stop_all(proc)
    return proc.returncode, out, time.monotonic() - started


def once(text: str, needle: str) -> None:
    assert text.count(needle) == 1, f"{needle!r} printed {text.count(needle)} times:\n{text[-4000:]}"


def test_a_misconfiguration_on_rank_0_of_two_trainer_ranks_ends_both_within_30_s(tiny_model_dir, recipe, tmp_path):
    # Only rank 0 checks the run folder (another run's is refused): rank 1 goes on to load the model and wait.
    out = tmp_path / "run"
    args = [recipe, *run_args(tiny_model_dir, out, **{"train.mode": "decoupled", "decoupled.trainer_ranks": 2,
                                                       "decoupled.address": f"tcp://127.0.0.1:{free_port()}"})]
    out.mkdir()
    (out / "config.yaml").write_text("another run\n")
    code, text, took = ends_within(torchrun("trainer", *args), 30)
    assert code != 0 and took < 30, (code, took, text[-4000:])
    once(text, f"grpo: rank 0 of 2 on {socket.gethostname()}: configuration error: train.output_dir")
    assert "exitcode  : 2" in text, text[-3000:]  # torchrun's summary names the rank's status; its own is 1
    assert (out / "config.yaml").read_text() == "another run\n"


def test_a_peer_timeout_on_rank_0_ends_both_trainer_ranks_after_the_timeout(tiny_model_dir, recipe, tmp_path):
    # No sampler ever comes: rank 0 times out after decoupled.peer_timeout_s while rank 1 waits in the broadcast
    # of the step's batch; both end then (rank 1 used to wait out the collective timeout).
    args = [recipe, *run_args(tiny_model_dir, tmp_path / "run", **{
        "train.mode": "decoupled", "decoupled.trainer_ranks": 2, "decoupled.peer_timeout_s": 5,
        "decoupled.address": f"tcp://127.0.0.1:{free_port()}"})]
    code, text, took = ends_within(torchrun("trainer", *args), 60)
    assert code != 0 and took < 60, (code, took, text[-4000:])
    once(text, "timed out: no rollout chunk from any sampler")
    assert f"grpo: rank 0 of 2 on {socket.gethostname()}: timed out" in text, text[-3000:]
    assert "grpo/decoupled/" not in text and "grpo/training/" not in text, text[-4000:]  # no rank's traceback


def test_a_failure_on_rank_1_of_deepspeeds_launcher_ends_every_rank_with_its_status(tiny_model_dir, recipe, tmp_path):
    # A reward that fails on rank 1 only: rank 0 waits in the step's collectives. DeepSpeed's launcher passes
    # the failed rank's status on (2: a broken reward), torchrun would answer 1.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "run"
    args = [recipe, *run_args(tiny_model_dir, out, rewards="[{name: 'rewards_for_reliability:fails_on_rank_1'}]")]
    code, text, took = ends_within(deepspeed_runner(hostfile, "train", *args), 60,
                                   env=dict(cli_env(), DS_BUILD_OPS="0", DS_ACCELERATOR="cpu"))
    assert code == 2 and took < 60, (code, took, text[-4000:])
    once(text, "reward 'fails_on_rank_1' failed on every one of")
    assert f"grpo: rank 1 of 2 on {socket.gethostname()}: reward error" in text, text[-3000:]
    assert not (out / "metrics.jsonl").exists() or train_rows(out) == []


def test_deepspeeds_launcher_runs_the_colocated_and_the_decoupled_trainer(tiny_model_dir, recipe, tmp_path):
    # `python -u -m grpo --local_rank=N train ...`: the flag before the subcommand (it was refused, exit 2).
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = dict(cli_env(), DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
    colocated = tmp_path / "colocated"
    code, text, _ = ends_within(deepspeed_runner(hostfile, "train", recipe,
                                                 *run_args(tiny_model_dir, colocated, **{"train.max_steps": 1})),
                                300, env=env)
    assert code == 0, text[-4000:]
    assert "'--local_rank=1', 'train'" in text, text[-3000:]  # two ranks, each told its rank DeepSpeed's way
    assert [r["step"] for r in train_rows(colocated)] == [1]

    decoupled = tmp_path / "decoupled"
    args = [recipe, *run_args(tiny_model_dir, decoupled, **{
        "train.mode": "decoupled", "train.max_steps": 2, "decoupled.trainer_ranks": 2,
        "decoupled.address": f"tcp://127.0.0.1:{free_port()}"})]
    sampler = start("sampler", *args)
    try:
        code, text, _ = ends_within(deepspeed_runner(hostfile, "trainer", *args), 300, env=env)
        assert code == 0, text[-4000:]
        sampler.wait(timeout=60)
    finally:
        stop_all(sampler)
    assert [r["step"] for r in train_rows(decoupled)] == [1, 2]


def accelerate_launch(*args) -> list[str]:
    """``accelerate launch --multi_gpu --num_processes 2 -m grpo ...`` as a user of accelerate types it: on a
    machine without GPUs accelerate still starts its ranks through torch.distributed.run (gloo on CPU)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(free_port()), "-m", "grpo", *map(str, args)]


def test_accelerates_launcher_runs_two_colocated_ranks(tiny_model_dir, recipe, tmp_path):
    out = tmp_path / "run"
    code, text, _ = ends_within(accelerate_launch("train", recipe, *run_args(tiny_model_dir, out, **{
        "train.max_steps": 2})), 300)
    assert code == 0, text[-4000:]
    assert [r["step"] for r in train_rows(out)] == [1, 2]
    once(text, "run folder:")  # the summary of the run, from rank 0 only


def test_a_failure_on_rank_1_under_accelerates_launcher_ends_both_ranks(tiny_model_dir, recipe, tmp_path):
    out = tmp_path / "run"
    args = [recipe, *run_args(tiny_model_dir, out, rewards="[{name: 'rewards_for_reliability:fails_on_rank_1'}]")]
    code, text, took = ends_within(accelerate_launch("train", *args), 60)
    assert code != 0 and took < 60, (code, took, text[-4000:])
    once(text, "reward 'fails_on_rank_1' failed on every one of")
    assert f"grpo: rank 1 of 2 on {socket.gethostname()}: reward error" in text, text[-3000:]
