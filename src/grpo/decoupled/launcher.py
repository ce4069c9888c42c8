"""``grpo train CONFIG train.mode=decoupled``: start every role on this machine and supervise them.

Order: the reference server (if configured; waited for), the trainer (``torchrun`` when it has
several ranks), then the samplers. The run ends when the trainer exits; samplers and the server are
then stopped. A sampler that dies is restarted (``decoupled.restart_samplers``). Ctrl-C is forwarded
to the trainer (which writes a checkpoint and exits 130) and the others are stopped.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from grpo.config import RunConfig

MAX_SAMPLER_RESTARTS = 5
GRACE_S = 20.0


def _configured_ports(cfg: RunConfig) -> set[int]:
    """The ports the roles will bind later: the master port must not take one of them before they do."""
    ports = {cfg.decoupled.ref_server_port, cfg.decoupled.weight_sync_port}
    tail = cfg.decoupled.address.rsplit(":", 1)[-1]
    if tail.isdigit():
        ports.add(int(tail))
    return ports


def _free_port(avoid: set[int]) -> int:
    # The kernel's bind(0) may hand out a configured port nothing listens on yet (the rollout address is bound only
    # when the trainer starts): torchrun's store would take it and the trainer fail with "Address already in use".
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def role_command(role: str, config_path: str | None, overrides: list[str]) -> list[str]:
    """``python -m grpo ROLE [CONFIG] overrides...``."""
    return [sys.executable, "-m", "grpo", role, *([config_path] if config_path else []), *overrides]


def trainer_command(cfg: RunConfig, config_path: str | None, overrides: list[str]) -> list[str]:
    ranks = cfg.decoupled.trainer_ranks
    if ranks == 1:
        return role_command("trainer", config_path, overrides)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(_free_port(_configured_ports(cfg))), *role_command("trainer", config_path, overrides)[1:]]


def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_decoupled(cfg: RunConfig, config_path: str | None, overrides: list[str]) -> int:
    """Start, supervise and stop the roles; returns the trainer's exit status."""
    overrides = [o for o in overrides if not o.startswith("train.mode=")] + ["train.mode=decoupled"]
    ref_server = None
    if cfg.decoupled.ref_server and cfg.loss.beta > 0:
        ref_server = subprocess.Popen(role_command("ref-server", config_path, overrides))
        overrides = overrides + [f"decoupled.ref_server_url=http://127.0.0.1:{cfg.decoupled.ref_server_port}"]
    trainer = subprocess.Popen(trainer_command(cfg, config_path, overrides))
    # Samplers never resume or overwrite a run folder: only the trainer owns it.
    sampler_overrides = [o for o in overrides if not o.startswith(("train.resume=", "train.overwrite="))]
    samplers: dict[int, subprocess.Popen] = {}
    restarts = dict.fromkeys(range(cfg.decoupled.num_samplers), 0)

    def start_sampler(k: int) -> None:
        samplers[k] = subprocess.Popen(role_command("sampler", config_path,
                                                    sampler_overrides + [f"decoupled.sampler_index={k}"]))

    for k in range(cfg.decoupled.num_samplers):
        start_sampler(k)
    try:
        while trainer.poll() is None:
            time.sleep(0.5)
            for k, proc in samplers.items():
                code = proc.poll()
                if code is not None and code != 0 and cfg.decoupled.restart_samplers:
                    if restarts[k] >= MAX_SAMPLER_RESTARTS:
                        print(f"grpo: sampler {k} failed {restarts[k] + 1} times (exit {code}); stopping the run",
                              file=sys.stderr)
                        _stop(trainer, signal.SIGINT)
                        break
                    restarts[k] += 1
                    print(f"grpo: sampler {k} exited with {code}; restarting it ({restarts[k]})", file=sys.stderr)
                    start_sampler(k)
            if ref_server is not None and ref_server.poll() is not None:
                print(f"grpo: the reference server exited with {ref_server.returncode}; stopping the run",
                      file=sys.stderr)
                _stop(trainer, signal.SIGINT)
        return trainer.wait()
    except KeyboardInterrupt:
        _stop(trainer, signal.SIGINT)  # it checkpoints the last finished step and exits 130
        return 130
    finally:
        for proc in samplers.values():
            _stop(proc)
        _stop(ref_server)
        _stop(trainer)
