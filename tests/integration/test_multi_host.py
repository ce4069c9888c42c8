"""More than one machine, on one: every "host" is a network namespace with its own address on a bridge
(tests/integration/netns.py), so nothing can reach a peer over loopback. Two torchrun nodes train together
(c10d rendezvous), survive a kill -9 of one node with --resume on both; decoupled roles on four hosts give
the one-host run's first step, and each misconfiguration fails within seconds naming the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import Host, hosts
from run_helpers import (
    SMOKE,
    cli_env,
    decoupled_overrides,
    free_port,
    grpo_cmd,
    logged_steps,
    train_rows,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def logged(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` with its output in ``log`` (a pipe nobody reads would fill up and stall it)."""
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)
    proc.log = log
    return proc


def output(proc: subprocess.Popen) -> str:
    return proc.log.read_text()[-3000:]


def torchrun_node(host: Host, head: Host, port: int, run_id: str, args: list[str], logs: Path) -> subprocess.Popen:
    """One node of a 2-node torchrun (one rank): c10d rendezvous on ``head``, gloo over the host's own
    interface, and the node's address given (its name resolves to loopback here, as on many machines)."""
    cmd = host.command([
        "env", f"GLOO_SOCKET_IFNAME={host.interface}", sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{head.address}:{port}",
        "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(host is head)}", "--local_addr", host.address,
        "-m", "grpo", "train", SMOKE, *args])
    return logged(cmd, logs / f"{host.name}-{run_id}.log")


def finish_all(procs: list[subprocess.Popen], timeout: float = 400) -> None:
    for proc in procs:
        proc.wait(timeout=timeout)
        assert proc.returncode == 0, output(proc)


def test_two_torchrun_nodes_in_two_namespaces_train_survive_a_kill_9_and_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = decoupled_overrides(tiny_model_dir, out, **{"train.max_steps": 6, "train.save_steps": 1})
    with hosts(2) as (head, other):
        port = free_port()  # the rendezvous port on the head node: one for both nodes
        nodes = [torchrun_node(h, head, port, "first", args, tmp_path) for h in (head, other)]
        try:
            wait_until(lambda: logged_steps(out) >= 2, "2 logged steps", timeout=300, proc=nodes[0])
            other.kill_all()  # the machine is gone: its torchrun agent and its rank
            nodes[1].wait()
            try:  # the survivor's collective fails when its peer's connection drops; else the scheduler kills it
                nodes[0].wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill_all()
                nodes[0].wait()
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    proc.kill()
        killed_at = logged_steps(out)
        assert killed_at < 6, "the run finished before the kill"
        port = free_port()
        nodes = [torchrun_node(h, head, port, "resumed", [*args, "train.resume=true"], tmp_path)
                 for h in (head, other)]
        finish_all(nodes)
    assert [r["step"] for r in train_rows(out)] == list(range(1, 7))
    assert (out / "final" / "model.safetensors").exists()


def role(host: Host, name: str, args: list[str], token: str, logs: Path, tag: str = "") -> subprocess.Popen:
    return logged(host.command(["env", f"GRPO_NS_TOKEN={token}", *grpo_cmd(name, SMOKE, *args)]),
                  logs / f"{name}{tag}.log")


def fails_within(proc: subprocess.Popen, seconds: float, *needles: str) -> None:
    started = time.monotonic()
    proc.wait(timeout=seconds + 60)
    took = time.monotonic() - started
    err = output(proc)
    assert proc.returncode not in (0, None), err[-2000:]
    assert took < seconds, f"took {took:.0f} s"
    for needle in needles:
        assert needle in err, err[-2000:]


def test_decoupled_roles_on_four_hosts_match_the_one_host_run_and_misconfigurations_fail_fast(
        tiny_model_dir, tmp_path):
    port, ref_port = free_port(), free_port()
    settings = {"train.mode": "decoupled", "train.max_steps": 2, "loss.beta": 0.1, "decoupled.ref_server": True,
                "decoupled.ref_server_port": ref_port, "decoupled.num_samplers": 2, "decoupled.trainer_ranks": 1,
                "decoupled.token_env": "GRPO_NS_TOKEN", "decoupled.peer_timeout_s": 120}
    one_host = tmp_path / "one-host"
    env = dict(cli_env(), GRPO_NS_TOKEN="t" * 32)
    result = subprocess.run(grpo_cmd("train", SMOKE, *decoupled_overrides(tiny_model_dir, one_host, **settings)),
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "hosts"
    with hosts(4) as (trainer_host, sampler_a, sampler_b, ref_host):
        shared = decoupled_overrides(tiny_model_dir, out, **settings, **{
            "decoupled.address": f"tcp://0.0.0.0:{port}",  # samplers read rank 0's address in the run folder
            "decoupled.ref_server_url": f"http://{ref_host.address}:{ref_port}"})
        ref = role(ref_host, "ref-server", [*shared, "decoupled.ref_server_host=0.0.0.0"], "t" * 32, tmp_path)
        trainer = role(trainer_host, "trainer", [*shared, f"decoupled.advertise_host={trainer_host.address}"],
                       "t" * 32, tmp_path)
        # Misconfigured samplers first, while the trainer waits for work to hand out: each fails fast, saying why.
        other_recipe = role(sampler_b, "sampler", [*shared, "decoupled.sampler_index=1", "rollout.temperature=0.5"],
                            "t" * 32, tmp_path, "-other-recipe")
        wrong_token = role(sampler_b, "sampler", [*shared, "decoupled.sampler_index=1"], "x" * 32, tmp_path,
                           "-wrong-token")
        elsewhere = role(sampler_b, "sampler", [*shared, "decoupled.sampler_index=1", "decoupled.peer_timeout_s=10",
                                                f"train.output_dir={tmp_path / 'not-shared'}"], "t" * 32,
                         tmp_path, "-elsewhere")
        samplers = []
        try:
            fails_within(other_recipe, 60, "runs another config")  # refused at its hello
            fails_within(wrong_token, 60, "token")  # the reference server refuses it first (401), at once
            fails_within(elsewhere, 60, "trainer_address.json", "same shared folder")  # after its 10 s
            published = (out / "decoupled" / "trainer_address.json").read_text()
            assert f"tcp://{trainer_host.address}:{port}" in published
            samplers = [role(h, "sampler", [*shared, f"decoupled.sampler_index={k}"], "t" * 32, tmp_path, str(k))
                        for k, h in enumerate((sampler_a, sampler_b))]
            trainer.wait(timeout=400)
            assert trainer.returncode == 0, output(trainer)
            for proc in samplers:
                proc.wait(timeout=120)
        finally:
            for proc in (ref, trainer, *samplers):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    a, b = train_rows(one_host)[0], train_rows(out)[0]
    assert a["kl"] > 0 or a["loss"] != 0
    for key in ("loss", "kl", "reward/mean", "reward/std", "completion_length/mean"):
        assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert [r["step"] for r in train_rows(out)] == [1, 2]


def test_a_trainer_whose_name_binds_only_loopback_is_refused_at_once(tiny_model_dir, tmp_path):
    # The machine's name mapped to 127.0.1.1 (Debian's installer writes such a line): a trainer told to bind
    # that name, or to bind every interface and publish that name, would be unreachable from other hosts.
    import socket

    with hosts(1) as (host,):
        host.resolve_as(f"127.0.0.1 localhost\n127.0.1.1 trainer-node {socket.gethostname()} {socket.getfqdn()}\n")
        base = decoupled_overrides(tiny_model_dir, tmp_path / "run", **{
            "train.mode": "decoupled", "decoupled.token_env": "GRPO_NS_TOKEN"})
        for address, needle in ((f"tcp://trainer-node:{free_port()}", "resolves only to loopback"),
                                (f"tcp://0.0.0.0:{free_port()}", "set decoupled.advertise_host")):
            trainer = role(host, "trainer", [*base, f"decoupled.address={address}"], "t" * 32, tmp_path,
                           address.split(":")[1].strip("/"))
            fails_within(trainer, 60, needle)
            assert trainer.returncode == 2, output(trainer)


def test_hosts_helper_has_no_path_between_hosts_but_the_bridge(tmp_path):
    # The premise of the tests above: a host cannot reach another's service over its own loopback.
    code = ("import socket, sys; s = socket.socket(); s.settimeout(3); "
            "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))")
    with hosts(2) as (a, b):
        port = free_port()
        server = subprocess.Popen(a.command([sys.executable, "-c", "import socket, time; s = socket.socket(); "
                                             f"s.bind(('0.0.0.0', {port})); s.listen(); time.sleep(30)"]))
        try:
            time.sleep(1.0)
            assert subprocess.run(b.command([sys.executable, "-c", code, a.address, str(port)])).returncode == 0
            assert subprocess.run(b.command([sys.executable, "-c", code, "127.0.0.1", str(port)])).returncode != 0
        finally:
            server.kill()
            server.wait()
    assert os.geteuid() == 0 and Path("/proc/self/ns/net").exists()
