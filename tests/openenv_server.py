"""An OpenEnv echo environment served locally, from what the installed ``openenv`` (grpo[openenv]) provides.

``openenv init echo_env`` writes the package TRL's OpenEnv guide imports (``from echo_env import EchoEnv``,
``from echo_env.models import EchoAction``: its template is the echo environment); the guide's "Server
concurrency" step raises its ``max_concurrent_envs`` so that every rollout's client gets a session; uvicorn then
serves ``echo_env.server.app:app`` on a free loopback port, as the guide's "Local Python process" does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from transport_helpers import free_port

START_TIMEOUT_S = 90  # the import of fastapi/fastmcp on two busy cores, with room to spare


@dataclass(frozen=True)
class EchoServer:
    url: str
    package_root: Path  # holds echo_env/: put it on PYTHONPATH to import the client


def write_echo_package(root: Path, env: dict) -> Path:
    """``openenv init echo_env`` under ``root``, with the guide's concurrency edit; the package folder."""
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(root)], env=env,
                   check=True, capture_output=True, timeout=120)
    app = root / "echo_env" / "server" / "app.py"
    text = app.read_text()
    assert text.count("max_concurrent_envs=1,") == 1, "openenv's template changed: see the guide's concurrency step"
    app.write_text(text.replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    return root / "echo_env"


def wait_listening(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the echo server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the echo server did not listen within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def echo_server(tmp_path_factory):
    """The running echo server (session-wide: a few seconds to start); skipped without openenv."""
    pytest.importorskip("openenv", reason="OpenEnv is an optional extra: pip install 'grpo[openenv]' (make test-openenv)")
    root = tmp_path_factory.mktemp("openenv")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    write_echo_package(root, env)
    port, log = free_port(), root / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1",
                                    "--port", str(port)], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_listening(process, port, log)
        yield EchoServer(url=f"http://127.0.0.1:{port}", package_root=root)
    finally:
        process.terminate()
        process.wait(timeout=30)
