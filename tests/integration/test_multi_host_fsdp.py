"""FSDP2 over two hosts, each a network namespace with its own address on a bridge (tests/integration/netns.py):
two torchrun nodes started with docs/guides/multi-node.md's command and ``train.fsdp=true`` shard the policy over
the two machines (every forward all-gathers across them), write one DCP shard each into the shared run folder,
survive a kill -9 of the other node with ``train.resume=true`` on both, and end on the weights of the same run
made on one host by two ranks, bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from netns import hosts
from run_helpers import SMOKE, cli_env, decoupled_overrides, free_port, logged_steps, train_rows, wait_until
from safetensors.torch import load_file
from test_multi_host import finish_all, output, torchrun_node

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_fsdp2_nodes_in_two_namespaces_train_survive_a_kill_9_and_equal_one_host(tiny_model_dir, tmp_path):
    settings = {"train.fsdp": True, "train.max_steps": 4, "train.save_steps": 1}
    one_host = tmp_path / "one-host"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "grpo", "train", SMOKE,
               *decoupled_overrides(tiny_model_dir, one_host, **settings)]
    result = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "two-hosts"
    args = decoupled_overrides(tiny_model_dir, out, **settings)
    with hosts(2) as (head, other):
        port = free_port()
        nodes = [torchrun_node(h, head, port, "first", args, tmp_path) for h in (head, other)]
        try:
            wait_until(lambda: logged_steps(out) >= 2, "2 logged steps", timeout=300, proc=nodes[0])
            other.kill_all()
            nodes[1].wait()
            nodes[0].wait(timeout=120)
            assert nodes[0].returncode != 0, output(nodes[0])
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert logged_steps(out) < 4, "the run finished before the kill"
        port = free_port()
        finish_all([torchrun_node(h, head, port, "resumed", [*args, "train.resume=true"], tmp_path)
                    for h in (head, other)])
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]
    shards = sorted(p.name for p in (out / "checkpoints" / "fsdp-step-4").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per node's rank
    two_hosts = load_file(out / "final" / "model.safetensors")
    want = load_file(one_host / "final" / "model.safetensors")
    assert all(torch.equal(two_hosts[k], want[k]) for k in want), "two hosts trained other weights than one host"
