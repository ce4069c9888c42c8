"""The SLURM launch recipes in examples/slurm/, on a machine without SLURM: the scripts parse; every grpo
command they start, read from a stand-in ``srun`` that records its command line after the shell expanded
it, loads through grpo's config loader the way the command line loads it; the decoupled roles agree on the
config they must share, the token and the addresses; and both scripts run for real on this machine with
stand-ins for ``srun`` (runs its command once) and ``scontrol`` (prints the node names it is given)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transport_helpers import free_port

from grpo.cli import build_parser
from grpo.config import RunConfig, load_config
from grpo.decoupled.link_settings import config_fingerprint
from grpo.decoupled.listen import shared_token
from grpo.decoupled.transport import check_bind_address
from grpo.run.run_dir import MARKERS

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "examples" / "slurm"
COLOCATED = SLURM_DIR / "colocated.sbatch"
DECOUPLED = SLURM_DIR / "decoupled.sbatch"

# Every srun option in the scripts is written --option=value, so the command starts at the first word
# without a leading dash.
# Records its call. The script stops the reference server and leaves when the trainer's srun returns, while
# other sruns run in the background: the trainer's record waits until SRUN_EXPECT calls are on file, so every
# call is recorded whatever the order the processes run in.
RECORDING_SRUN = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
log_path = os.environ["SRUN_LOG"]
with open(log_path, "a") as log:
    log.write(json.dumps({{"options": options, "command": args, "token": os.environ.get("GRPO_TOKEN")}}) + "\\n")
if "trainer" in args:
    deadline = time.monotonic() + 60
    while sum(1 for _ in open(log_path)) < int(os.environ.get("SRUN_EXPECT", "1")) and time.monotonic() < deadline:
        time.sleep(0.02)
"""
EXEC_SRUN = """#!/bin/bash
while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: only 'show hostnames'" >&2; exit 1; }
printf '%s\\n' $FAKE_HOSTS
"""
TORCHRUN = """#!/bin/bash
exec {python} -m torch.distributed.run "$@"
"""


def shims(folder: Path, srun: str) -> Path:
    folder.mkdir()
    for name, text in (("srun", srun), ("scontrol", SCONTROL), ("torchrun", TORCHRUN)):
        (folder / name).write_text(text.format(python=sys.executable) if name != "scontrol" else text)
        (folder / name).chmod(0o755)
    return folder


def script_env(hosts: list[str], shim_dir: Path, **env) -> dict[str, str]:
    """The environment sbatch would give a script on the first of ``hosts`` (SLURM's variables faked)."""
    base = {k: v for k, v in os.environ.items() if k != "GRPO_TOKEN" and not k.startswith("SLURM_")}
    python_path = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return {**base, "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": python_path,
            "PYTHON": sys.executable, "FAKE_HOSTS": " ".join(hosts), "SLURM_NNODES": str(len(hosts)),
            "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": f"node[0-{len(hosts) - 1}]", "SLURM_CPUS_PER_TASK": "16",
            "SLURM_GPUS_ON_NODE": "8", "OMP_NUM_THREADS": "1", **env}


def run_script(script: Path, shim_dir: Path, hosts: list[str], timeout: float = 60,
               **env) -> subprocess.CompletedProcess:
    """``bash SCRIPT`` from the checkout (recipes are relative to it), as sbatch starts it."""
    return subprocess.run(["bash", str(script)], cwd=REPO, env=script_env(hosts, shim_dir, **env),
                          capture_output=True, text=True, timeout=timeout)


def recorded(script: Path, tmp_path: Path, hosts: list[str], **env) -> list[dict]:
    """The srun calls of ``script`` (nothing runs): options, command, the GRPO_TOKEN the task would see."""
    log = tmp_path / "srun.jsonl"
    result = run_script(script, shims(tmp_path / "bin", RECORDING_SRUN), hosts, SRUN_LOG=str(log), **env)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def grpo_argv(command: list[str]) -> list[str]:
    """What follows ``-m grpo`` in ``torchrun ... -m grpo ROLE ...`` or ``python -m grpo ROLE ...``."""
    for i in range(len(command) - 1):
        if command[i:i + 2] == ["-m", "grpo"]:
            return command[i + 2:]
    raise AssertionError(f"no `-m grpo` in {command}")


def load_as_the_cli_does(argv: list[str]) -> tuple[str, RunConfig]:
    """The subcommand and the config ``grpo ARGV`` would run with (grpo.cli: --resume and --host are
    overrides too); the recipe, relative to the checkout the scripts are submitted from, must exist."""
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if getattr(args, "resume", False):
        overrides.append("train.resume=true")
    if getattr(args, "host", None):
        overrides.append(f"decoupled.ref_server_host={args.host}")
    assert args.config and (REPO / args.config).is_file(), f"recipe {args.config} is not in the checkout"
    return args.command, load_config(REPO / args.config, overrides)


ECHO_TORCHRUN = """#!{python}
import json, sys
print(json.dumps(sys.argv[1:]))
"""


def on_node(command: list[str], node_id: int, tmp_path: Path) -> list[str]:
    """The torchrun command line that ``command`` (``bash -c SCRIPT torchrun ARGS``: evaluated on each node)
    runs on the node with SLURM_NODEID ``node_id``, through a torchrun stand-in that prints its arguments."""
    assert command[:2] == ["bash", "-c"] and command[3] == "torchrun", command
    folder = tmp_path / "echo-bin"
    folder.mkdir(exist_ok=True)
    (folder / "torchrun").write_text(ECHO_TORCHRUN.format(python=sys.executable))
    (folder / "torchrun").chmod(0o755)
    env = dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}", SLURM_NODEID=str(node_id))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    return ["torchrun", *json.loads(result.stdout)]


def option(words: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {words}"
    return values[0]


def test_the_scripts_parse_and_look_for_every_run_marker():
    for script in (COLOCATED, DECOUPLED):
        subprocess.run(["bash", "-n", str(script)], check=True)
        # The resume decision mirrors grpo's own test of a folder holding a run (grpo.run.run_dir).
        assert f"for marker in {' '.join(MARKERS)}; do" in script.read_text()


@pytest.mark.parametrize("existing_run", [False, True], ids=["new-run-folder", "run-folder-holds-a-run"])
def test_colocated_starts_one_torchrun_per_node_with_a_valid_config(tmp_path, existing_run):
    run_dir = tmp_path / "run"
    if existing_run:  # a requeued or resubmitted job: the run continues
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text("{}\n")
    hosts = ["node0", "node1"]
    (call,) = recorded(COLOCATED, tmp_path, hosts, RUN_DIR=str(run_dir))
    assert option(call["options"], "--nodes") == "2" and option(call["options"], "--ntasks-per-node") == "1"
    head, other = on_node(call["command"], 0, tmp_path), on_node(call["command"], 1, tmp_path)
    torchrun = head[:head.index("-m")]
    # Where node names resolve only to loopback torchrun finds no head by name: each node says if it is.
    assert option(torchrun, "--rdzv_conf") == "is_host=1" and option(other, "--rdzv_conf") == "is_host=0"
    assert option(torchrun, "--nnodes") == "2" and option(torchrun, "--nproc_per_node") == "8"
    assert option(torchrun, "--rdzv_backend") == "c10d" and option(torchrun, "--rdzv_id") == "42"
    assert option(torchrun, "--rdzv_endpoint") == "node0:29500"  # the first node of the allocation
    role, cfg = load_as_the_cli_does(grpo_argv(call["command"]))
    assert role == "train" and cfg.train.mode == "colocated"
    assert cfg.train.output_dir == str(run_dir) and cfg.train.resume is existing_run
    assert cfg.train.prompts_per_step % (2 * 8) == 0, "every rank gets the same number of prompts"


@pytest.mark.parametrize("ref_server", [True, False], ids=["with-reference-server", "samplers-hold-the-reference"])
def test_decoupled_roles_share_one_config_token_and_addresses(tmp_path, monkeypatch, ref_server):
    run_dir = tmp_path / "run"
    stale = run_dir / "decoupled" / "trainer_address.json"  # left by a previous job of this run
    stale.parent.mkdir(parents=True)
    stale.write_text('{"address": "tcp://gone:5555"}')
    hosts = ["node0", "node1", "node2", "node3"]
    calls = recorded(DECOUPLED, tmp_path, hosts, RUN_DIR=str(run_dir), REF_SERVER=str(int(ref_server)),
                     SRUN_EXPECT=str(len(hosts)))  # one srun per node
    assert not stale.exists(), "samplers would read the previous trainer's address"

    roles: dict[str, list[tuple[dict, RunConfig]]] = {}
    for call in calls:
        role, cfg = load_as_the_cli_does(grpo_argv(call["command"]))
        roles.setdefault(role, []).append((call, cfg))
    assert sorted(roles) == (["ref-server", "sampler", "trainer"] if ref_server else ["sampler", "trainer"])

    ((trainer_call, trainer),) = roles["trainer"]
    head = on_node(trainer_call["command"], 0, tmp_path)
    torchrun = head[:head.index("-m")]
    assert option(torchrun, "--rdzv_conf") == "is_host=1" and option(trainer_call["options"], "--nodelist") == "node0"
    ranks = int(option(torchrun, "--nnodes")) * int(option(torchrun, "--nproc_per_node"))
    assert trainer.decoupled.trainer_ranks == ranks
    samplers = roles["sampler"]
    sampler_nodes = hosts[1:-1] if ref_server else hosts[1:]
    placed = {cfg.decoupled.sampler_index: option(call["options"], "--nodelist") for call, cfg in samplers}
    assert placed == dict(enumerate(sampler_nodes)) and len(samplers) == len(sampler_nodes)  # sampler k on node k + 1
    assert trainer.decoupled.num_samplers == len(sampler_nodes)

    # The trainer refuses a sampler whose config hash differs from its own.
    assert {config_fingerprint(cfg) for _, cfg in samplers} == {config_fingerprint(trainer)}
    assert trainer.train.mode == "decoupled" and not any(cfg.train.resume for _, cfg in samplers)
    assert trainer.train.max_staleness == 0  # on-policy: the samplers share each step's chunks

    # One token, inherited by every task, named by decoupled.token_env; the trainer may listen on all interfaces.
    (token,) = {call["token"] for call in calls}
    assert token and len(token) == 64
    monkeypatch.setenv("GRPO_TOKEN", token)
    assert {shared_token(cfg) for items in roles.values() for _, cfg in items} == {token}
    check_bind_address(trainer.decoupled.address, token)
    assert trainer.decoupled.address == "tcp://0.0.0.0:5555"  # samplers read the reachable one in RUN_DIR

    if ref_server:
        ((ref_call, ref),) = roles["ref-server"]
        assert option(ref_call["options"], "--nodelist") == hosts[-1] and ref.decoupled.ref_server_host == "0.0.0.0"
        urls = {cfg.decoupled.ref_server_url for _, cfg in samplers}
        assert urls == {f"http://{hosts[-1]}:{ref.decoupled.ref_server_port}"}
    else:
        assert all(cfg.decoupled.ref_server_url is None for _, cfg in samplers)


def test_decoupled_refuses_an_allocation_without_a_sampler_node(tmp_path):
    result = run_script(DECOUPLED, shims(tmp_path / "bin", RECORDING_SRUN), ["node0", "node1"],
                        RUN_DIR=str(tmp_path / "run"), SRUN_LOG=str(tmp_path / "srun.jsonl"))
    assert result.returncode == 2
    assert "2 nodes leave none for a sampler (1 trainer, 1 reference server)" in result.stderr


# A one-step CPU run of the shipped tiny model (configs/smoke-cpu.yaml: assets/tiny-math, synthetic data).
TINY_RUN = ("train.max_steps=1 data.eval=null train.prompts_per_step=2 rollout.max_completion_length=12 "
            "log.report_to=[] log.progress_bar=false log.plots=false")


@pytest.mark.integration
@pytest.mark.slow
def test_colocated_trains_on_this_machine_with_srun_and_scontrol_stand_ins(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script(COLOCATED, shims(tmp_path / "bin", EXEC_SRUN), ["localhost"], timeout=240,
                        RUN_DIR=str(run_dir), GPUS="1", RDZV_PORT=str(free_port()),
                        GRPO_RECIPE="configs/smoke-cpu.yaml", GRPO_EXTRA=TINY_RUN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 nodes x 1 ranks, rendezvous localhost:" in result.stdout and "(resume: false)" in result.stdout
    assert (run_dir / "checkpoints" / "step-1").is_dir() and (run_dir / "final").is_dir()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.integration
@pytest.mark.slow
def test_decoupled_trains_on_this_machine_and_sigterm_to_the_script_saves_the_last_step(tmp_path):
    # Three "nodes", all this machine: trainer, one sampler, the reference server (the recipe's beta > 0).
    # SIGTERM to the script, as --signal=B:TERM@120 sends it before the time limit: the trainer saves its
    # last finished step, and its bye ends the sampler, which kept feeding it meanwhile.
    import signal
    import threading
    import time

    run_dir = tmp_path / "run"
    env = script_env(["localhost"] * 3, shims(tmp_path / "bin", EXEC_SRUN), RUN_DIR=str(run_dir), GPUS="1",
                     RDZV_PORT=str(free_port()), ROLLOUT_PORT=str(free_port()), REF_PORT=str(free_port()),
                     GRPO_RECIPE="configs/smoke-cpu.yaml",
                     GRPO_EXTRA=TINY_RUN.replace("max_steps=1", "max_steps=100") + " train.save_steps=1000"
                                " decoupled.peer_timeout_s=120"
                                # every "node" is this machine, whose name may resolve only to loopback
                                " decoupled.advertise_host=127.0.0.1")
    proc = subprocess.Popen(["bash", str(DECOUPLED)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # read until every process of the "job" closed the pipe (the sampler exits last)
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:] or "no step logged"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
        reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert "grpo: SIGTERM: asking the trainer to save its last finished step and stop" in output, output[-4000:]
    assert "sampler-0: the trainer finished; exiting" in output, output[-4000:]
    assert '"POST /v1/logprobs HTTP/1.1" 200' in output, "the sampler got its reference log-probs from the server"
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(logged) < 100 and logged == list(range(1, len(logged) + 1))
    saved = [path.name for path in (run_dir / "checkpoints").iterdir()]
    assert saved == [f"step-{logged[-1]}"], "the interrupt saved the last logged step (none was scheduled)"
