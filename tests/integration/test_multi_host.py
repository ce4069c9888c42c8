"""More than one machine, on one: every "host" is a network namespace with its own address on a bridge
(tests/integration/netns.py), so nothing can reach a peer over loopback. Two torchrun nodes, started with the
command of docs/guides/multi-node.md, train together (c10d rendezvous), survive a kill -9 of one node with --resume on both, and
stop together when a rank fails on one; DeepSpeed's launcher runs both trainers over two hosts; decoupled
roles on four hosts give the one-host run's first step, and each misconfiguration fails within seconds naming
the cause."""

from __future__ import annotations

import os
import shlex
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


MULTI_NODE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "multi-node.md"


def docs_torchrun_command() -> list[str]:
    """The per-node torchrun command of docs/guides/multi-node.md, as words with its placeholders."""
    text = MULTI_NODE_PAGE.read_text()
    start = text.index("torchrun --nnodes N")
    block = text[start:text.index("```", start)]
    words = []
    for line in block.splitlines():
        words += line.split("#")[0].replace("\\", " ").split()
    return words


def torchrun_node(host: Host, head: Host, port: int, run_id: str, args: list[str], logs: Path,
                  hidden: Path | None = None) -> subprocess.Popen:
    """One node of a 2-node torchrun (one rank), run as docs/guides/multi-node.md says: c10d rendezvous at the head's address,
    ``is_host`` on the head, the node's address given (its name resolves to loopback here, as on many
    machines), and gloo over the host's own interface. ``hidden``: a folder this node does not share (an
    empty tmpfs over it, in the node's own mount namespace)."""
    values = {"N": "2", "G": "1", "HEAD_IP:29500": f"{head.address}:{port}", "JOB": run_id,
              "is_host=1": f"is_host={int(host is head)}", "NODE_IP": host.address, "RECIPE": SMOKE}
    documented = docs_torchrun_command()
    assert documented[0] == "torchrun" and documented[-1] == "..." and set(values) <= set(documented), documented
    words = [values.get(w, w) for w in documented]
    node = ["env", f"GLOO_SOCKET_IFNAME={host.interface}", sys.executable, "-m", "torch.distributed.run",
            *words[1:-1], *args]
    if hidden is not None:
        node = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"mount -t tmpfs tmpfs {shlex.quote(str(hidden))} && exec {shlex.join(map(str, node))}"]
    return logged(host.command(node), logs / f"{host.name}-{run_id}.log")


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
            killed = time.monotonic()
            nodes[0].wait(timeout=120)  # its collective fails when the peer's connection drops
            assert time.monotonic() - killed < 60, "the surviving node hung"
            assert nodes[0].returncode != 0, output(nodes[0])
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


def test_a_failure_on_the_other_host_stops_the_head_nodes_rank_within_seconds(tiny_model_dir, tmp_path):
    # A reward that fails on rank 1 only (the other node): rank 0 waits in the step's collectives on the head
    # node, and stops through the failure recorded in the head's rendezvous store, with rank 1's status.
    out = tmp_path / "run"
    args = decoupled_overrides(tiny_model_dir, out, **{
        "rewards": "[{name: 'rewards_for_reliability:fails_on_rank_1'}]"})
    with hosts(2) as (head, other):
        port = free_port()
        nodes = [torchrun_node(h, head, port, "failing", args, tmp_path) for h in (head, other)]
        try:
            nodes[1].wait(timeout=300)  # the failing rank's node
            failed = time.monotonic()
            nodes[0].wait(timeout=120)
            took = time.monotonic() - failed
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    head_log, other_log = output(nodes[0]), output(nodes[1])
    assert all(node.returncode != 0 for node in nodes), (head_log, other_log)
    assert took < 60, f"the head node's rank stopped {took:.0f} s after the other node's"  # a hang: 30 min
    assert "reward error: reward 'fails_on_rank_1' failed on every one" in other_log, other_log
    assert "grpo: rank 1 of 2 on " in other_log
    assert "grpo: rank 0 on " in head_log and "stops: rank 1 on " in head_log and "(exit 2" in head_log, head_log
    assert "failed on every one" not in head_log  # printed once, by the rank that failed


def deepspeed_node(host: Host, head: Host, hostfile: Path, port: int, role_args: list[str], logs: Path,
                   tag: str) -> subprocess.Popen:
    """One node of DeepSpeed's launcher as a cluster without ssh runs it: the same hostfile everywhere, this
    node's index, the head's address (DeepSpeed then starts ``python -u -m grpo --local_rank=0 ROLE ...``)."""
    index = 0 if host is head else 1
    cmd = host.command(["env", f"GLOO_SOCKET_IFNAME={host.interface}", "DS_BUILD_OPS=0", "DS_ACCELERATOR=cpu",
                        "GRPO_NS_TOKEN=" + "t" * 32, sys.executable, "-m", "deepspeed.launcher.runner",
                        "--hostfile", hostfile, "--no_ssh", "--node_rank", str(index), "--master_addr", head.address,
                        "--master_port", str(port), "--module", "grpo", *role_args])
    return logged(cmd, logs / f"ds-{tag}-{host.name}.log")


def test_deepspeeds_launcher_on_two_hosts_runs_the_colocated_and_the_decoupled_trainer(tiny_model_dir, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")  # names are only keys with --no_ssh
    with hosts(2) as (head, other):
        colocated = tmp_path / "colocated"
        args = ["train", SMOKE, *decoupled_overrides(tiny_model_dir, colocated, **{"train.max_steps": 1})]
        port = free_port()
        finish_all([deepspeed_node(h, head, hostfile, port, args, tmp_path, "colocated") for h in (head, other)])
        assert [r["step"] for r in train_rows(colocated)] == [1]

        decoupled = tmp_path / "decoupled"
        shared = decoupled_overrides(tiny_model_dir, decoupled, **{
            "train.mode": "decoupled", "train.max_steps": 2, "decoupled.trainer_ranks": 2,
            "decoupled.token_env": "GRPO_NS_TOKEN", "decoupled.address": f"tcp://0.0.0.0:{free_port()}"})
        port = free_port()
        trainers = [deepspeed_node(h, head, hostfile, port,
                                   ["trainer", SMOKE, *shared, f"decoupled.advertise_host={head.address}"],
                                   tmp_path, "decoupled") for h in (head, other)]
        sampler = role(other, "sampler", shared, "t" * 32, tmp_path)
        try:
            finish_all(trainers)
            sampler.wait(timeout=120)
        finally:
            for proc in (*trainers, sampler):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert [r["step"] for r in train_rows(decoupled)] == [1, 2]


def role(host: Host, name: str, args: list[str], token: str, logs: Path, tag: str = "",
         ranks: int = 1, env: tuple[str, ...] = ()) -> subprocess.Popen:
    """``grpo NAME`` on ``host``; with ``ranks`` > 1 under torchrun (the trainer's ranks on one host); ``env``:
    more ``NAME=value`` settings of its environment."""
    cmd = grpo_cmd(name, SMOKE, *args)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), *cmd[1:]]
    return logged(host.command(["env", f"GRPO_NS_TOKEN={token}", *env, *cmd]), logs / f"{name}{tag}.log")


def fails_within(proc: subprocess.Popen, seconds: float, *needles: str) -> None:
    started = time.monotonic()
    proc.wait(timeout=seconds + 60)
    took = time.monotonic() - started
    err = proc.log.read_text()
    assert proc.returncode not in (0, None), err[-2000:]
    assert took < seconds, f"took {took:.0f} s"
    for needle in needles:
        assert needle in err, err[-4000:]


def test_decoupled_roles_on_four_hosts_match_the_one_host_run_and_misconfigurations_fail_fast(
        tiny_model_dir, tmp_path):
    port, ref_port = free_port(), free_port()
    settings = {"train.mode": "decoupled", "train.max_steps": 2, "loss.beta": 0.1, "decoupled.ref_server": True,
                "decoupled.ref_server_port": ref_port, "decoupled.num_samplers": 2, "decoupled.trainer_ranks": 2,
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
                       "t" * 32, tmp_path, ranks=2)  # two trainer ranks, as every failure row is tested with
        # Misconfigured samplers first, while the trainer waits for work to hand out: each fails fast, saying why
        # (timed from when the trainer's ranks are up and its address is published, not from their start).
        wait_until(lambda: (out / "decoupled" / "trainer_address.json").exists(), "the trainer's address",
                   timeout=300, proc=trainer)
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
        # Two trainer ranks: only rank 0 publishes the address, so only rank 0 finds it wrong. Rank 1 must not
        # be left waiting for it in the step's broadcast (it was, silently, for the collective timeout).
        wildcard = [*base, f"decoupled.address=tcp://0.0.0.0:{free_port()}", "decoupled.trainer_ranks=2"]
        trainer = logged(host.command(["env", "GRPO_NS_TOKEN=" + "t" * 32, sys.executable, "-m",
                                       "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                                       str(free_port()), "-m", "grpo", "trainer", SMOKE, *wildcard]),
                         tmp_path / "two-ranks.log")
        fails_within(trainer, 30, "grpo: rank 0 of 2 on ", "set decoupled.advertise_host", "exitcode  : 2")
        assert trainer.log.read_text().count("set decoupled.advertise_host") == 1, output(trainer)


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
