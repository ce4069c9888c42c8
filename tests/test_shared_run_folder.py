"""Every rank must see the run folder rank 0 claimed (grpo.training.prepare.check_shared_run_folder): two real
ranks, the second in its own mount namespace with an empty tmpfs over the folder, as a node without the
shared filesystem would be."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from transport_helpers import free_port

RANK_SCRIPT = """
import sys
from pathlib import Path
from grpo.config import ConfigError
from grpo.parallel.distributed import init_distributed, shutdown
from grpo.training.prepare import check_shared_run_folder
info = init_distributed("cpu", timeout_s=60)
try:
    check_shared_run_folder(Path(sys.argv[1]), info)
    print("shared")
except ConfigError as err:
    print("error:", err)
shutdown(info)
"""


def run_two_ranks(out, second_rank_mounts_tmpfs: bool) -> list[str]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        command = [sys.executable, "-c", RANK_SCRIPT, str(out)]
        if rank == 1 and second_rank_mounts_tmpfs:
            quoted = " ".join(f"'{c}'" for c in command)
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       f"mount -t tmpfs tmpfs '{out}' && exec {quoted}"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        outputs.append(stdout.strip())
    return outputs


def test_ranks_that_share_the_folder_pass(tmp_path):
    (tmp_path / "run").mkdir()
    assert run_two_ranks(tmp_path / "run", second_rank_mounts_tmpfs=False) == ["shared", "shared"]
    assert not (tmp_path / "run" / ".grpo-shared-check").exists()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_rank_on_another_filesystem_is_named_on_every_rank(tmp_path):
    (tmp_path / "run").mkdir()
    outputs = run_two_ranks(tmp_path / "run", second_rank_mounts_tmpfs=True)
    for output in outputs:
        assert output.startswith("error: train.output_dir:") and "rank 1 on" in output, output
        assert "rank 0" not in output.split("cannot see")[0]
