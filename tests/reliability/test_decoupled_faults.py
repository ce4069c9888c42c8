"""Decoupled mode with real processes: a reference server killed and restarted, a sampler that stalls.
(A sampler or a trainer killed with kill -9 and restarted: tests/integration/test_decoupled.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from reliability_helpers import run_args
from run_helpers import cli_env, each_batch_once, free_port, logged_steps, start, stop_all, train_rows, wait_until

from grpo.run.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]


def decoupled_args(model_dir, out, **extra) -> list[str]:
    return run_args(model_dir, out, **{"train.mode": "decoupled", "decoupled.address": f"tcp://127.0.0.1:{free_port()}",
                                       "decoupled.peer_timeout_s": 120, **extra})


@pytest.mark.parametrize("retry_s", [1, 120], ids=["after-the-retry-window", "within-the-retry-window"])
def test_ref_server_killed_and_restarted(tiny_model_dir, recipe, tmp_path, retry_s):
    # Restarted within decoupled.ref_server_retry_s, the server is picked up by the waiting sampler.
    # After it, the sampler has exited with an error (the launcher restarts a sampler that does) and a
    # new one resends or samples again. Either way the run finishes, every batch once, each with its KL.
    out, port, steps = tmp_path / "run", free_port(), 5
    args = [recipe, *decoupled_args(tiny_model_dir, out, **{
        "train.max_steps": steps, "loss.beta": 0.1, "decoupled.ref_server_url": f"http://127.0.0.1:{port}",
        "decoupled.ref_server_port": port, "decoupled.ref_server_retry_s": retry_s})]
    server = start("ref-server", *args)
    trainer = start("trainer", *args, stderr=subprocess.PIPE)
    sampler = start("sampler", *args)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two trained steps", proc=trainer)
        # The kill must come before the sampler's last reference request, or there is no failed request to
        # test (a sampler that sampled every batch just exits 0 on the trainer's bye). Frozen, the trainer
        # acknowledges nothing more, so the sampler (max_staleness 0: one batch in flight) samples at most
        # one more batch: batches trained + 2 .. steps are requested from the killed server.
        trainer.send_signal(signal.SIGSTOP)
        trained = logged_steps(out)
        server.send_signal(signal.SIGKILL)
        server.wait()
        trainer.send_signal(signal.SIGCONT)
        assert trained + 2 <= steps, (f"{trained} of {steps} steps were trained when the server was killed: the "
                                      f"sampler may have made its last reference request already")
        if retry_s == 1:
            sampler.wait(timeout=120)  # its next reference request fails once the 1 s of retries is spent
            assert sampler.returncode != 0
            sampler = start("sampler", *args)  # waits for the server to answer before sampling
        else:
            time.sleep(3)  # the sampler's requests fail meanwhile; it keeps retrying
            assert sampler.poll() is None, "the sampler gave up inside its retry window"
        server = start("ref-server", *args)
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
        sampler.wait(timeout=60)  # the trainer's bye ends it
        assert sampler.returncode == 0
    finally:
        stop_all(trainer, sampler, server)
    each_batch_once(out, steps)
    assert all(r["kl"] is not None for r in train_rows(out)), "every step had reference log-probs"


def test_stalled_sampler_times_out_with_the_checkpoint_intact_then_resume_finishes(tiny_model_dir, recipe, tmp_path):
    # Stopped once 2 steps are logged, the sampler has sent at most the batch of the next step
    # (max_staleness 0: one batch in flight), so the trainer waits in vain for batch `trained + 2`. 5 steps
    # leave room for one step more logged by the time the sampler stops; 4 would not.
    out, steps = tmp_path / "run", 5
    args = [recipe, *decoupled_args(tiny_model_dir, out, **{"train.max_steps": steps, "decoupled.peer_timeout_s": 4})]
    trainer = start("trainer", *args, stderr=subprocess.PIPE)
    sampler = start("sampler", *args)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two trained steps", proc=trainer)
        sampler.send_signal(signal.SIGSTOP)  # alive but silent: a hung process, a frozen machine
        stopped_at = logged_steps(out)
        assert stopped_at + 2 <= steps, (f"{stopped_at} of {steps} steps were trained when the sampler stopped: "
                                         f"its batches may all be sent, and the trainer would finish")
        _, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 1, err[-3000:]
        assert "grpo: timed out: no rollout chunk from any sampler for" in err, err[-3000:]
        trained = logged_steps(out)
        assert latest_checkpoint(out).name == f"step-{trained}", "the last trained step is checkpointed"
        sampler.send_signal(signal.SIGCONT)
        stop_all(sampler)

        trainer = start("trainer", *args, "train.resume=true", stderr=subprocess.PIPE)
        sampler = start("sampler", *args)
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
    finally:
        stop_all(trainer, sampler)
    each_batch_once(out, steps)
    state = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())
    assert len(state["trained_batch_ids"]) == steps


def test_sigterm_to_two_trainer_ranks_waiting_for_gone_samplers_saves_the_last_step_at_once(
        tiny_model_dir, recipe, tmp_path):
    # A preempted job: the samplers are gone, and rank 0 waits for chunks (the other rank in the broadcast of
    # the step's batch). SIGTERM must not wait out decoupled.peer_timeout_s (600 s here): rank 0 stops
    # waiting, tells the other rank, and both save the last finished step.
    import sys

    out, steps = tmp_path / "run", 50
    args = [recipe, *decoupled_args(tiny_model_dir, out, **{"train.max_steps": steps, "decoupled.trainer_ranks": 2,
                                                              "decoupled.peer_timeout_s": 600})]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "grpo", "trainer", *map(str, args)], env=cli_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    sampler = start("sampler", *args)
    try:
        wait_until(lambda: logged_steps(out) >= 2, "two trained steps", proc=trainer)
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        time.sleep(2)  # the trainer is waiting for chunks now (after the chunk the sampler may have sent)
        started = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=120)
        assert time.monotonic() - started < 60, "the ranks waited for the gone samplers"
        assert trainer.returncode != 0, err[-3000:]
        assert latest_checkpoint(out).name == f"step-{logged_steps(out)}", err[-3000:]  # the last logged step
    finally:
        stop_all(trainer, sampler)
