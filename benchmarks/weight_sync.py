"""Publishing one weights version to a sampler: through files (``WeightStore.publish`` + one verified
``load``) against the broadcast (``WeightBroadcast.send`` from rank 0 + ``receive`` in one receiver process),
for the tiny Qwen2 and a bigger random one, on this machine's CPU.

    python benchmarks/weight_sync.py [--repeats 3] [--threads 2]

The table gives medians over the repeats: for files the trainer's part (publish: safetensors, SHA-256,
fsync) and the sampler's (load, checksums verified); for the broadcast the trainer's part (send returns)
and the whole transfer (from send's start to the receiver holding the state dict; both clocks are the
machine's monotonic clock). Under ``decoupled.weight_sync: broadcast`` the trainer still writes the files,
in a thread behind the send. Results: benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = {"tiny (hidden 64, 2 layers)": {"hidden_size": 64, "num_layers": 2},
          "bigger (hidden 512, 8 layers)": {"hidden_size": 512, "num_layers": 8}}


def model_state(hidden_size: int, num_layers: int) -> dict[str, torch.Tensor]:
    """A random Qwen2's state dict as the trainer publishes it (tied duplicates left out, CPU copies)."""
    from grpo.models.tiny import build_qwen2, build_tokenizer
    from grpo.weight_store import state_dict_for_publish

    model = build_qwen2(build_tokenizer(), hidden_size=hidden_size, num_layers=num_layers, seed=0)
    return {k: v.clone() for k, v in state_dict_for_publish(model)[0].items()}


def time_files(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    from grpo.weight_store import WeightStore

    publish, load = [], []
    with tempfile.TemporaryDirectory() as folder:
        store = WeightStore(folder)
        for version in range(1, repeats + 1):
            started = time.perf_counter()
            store.publish(version, state, kind="full", keep=2)
            publish.append(time.perf_counter() - started)
            started = time.perf_counter()
            store.load(version)
            load.append(time.perf_counter() - started)
    return {"publish_s": statistics.median(publish), "load_s": statistics.median(load),
            "total_s": statistics.median(p + q for p, q in zip(publish, load))}


def receiver(port: int, threads: int, done) -> None:
    """Group rank 1: receives every version and reports the monotonic time it held each."""
    from grpo.weight_store.broadcast import WeightBroadcast

    torch.set_num_threads(threads)
    group = WeightBroadcast("127.0.0.1", port, 1, 2, join_timeout_s=120, op_timeout_s=120)
    while (received := group.receive()) is not None:
        done.send((received[0], time.monotonic()))


def time_broadcast(state: dict[str, torch.Tensor], repeats: int, threads: int) -> dict[str, float]:
    from grpo.weight_store.broadcast import WeightBroadcast

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(target=receiver, args=(port, threads, theirs), daemon=True)
    process.start()
    group = WeightBroadcast("127.0.0.1", port, 0, 2, join_timeout_s=120, op_timeout_s=120)
    send, total = [], []
    for version in range(1, repeats + 1):
        started = time.monotonic()
        group.send(version, state)
        send.append(time.monotonic() - started)
        got, held_at = ours.recv()
        assert got == version
        total.append(held_at - started)
    group.close()
    process.join(60)
    return {"send_s": statistics.median(send), "total_s": statistics.median(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, shape in MODELS.items():
        state = model_state(**shape)
        mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        rows.append({"model": name, "tensors": len(state), "megabytes": round(mb, 1),
                     "files": time_files(state, args.repeats),
                     "broadcast": time_broadcast(state, args.repeats, args.threads)})
    print(f"{'model':32} {'MiB':>7} {'files publish':>14} {'files load':>11} {'files total':>12} "
          f"{'bcast send':>11} {'bcast total':>12}")
    for r in rows:
        f, b = r["files"], r["broadcast"]
        print(f"{r['model']:32} {r['megabytes']:7.1f} {f['publish_s']:13.3f}s {f['load_s']:10.3f}s "
              f"{f['total_s']:11.3f}s {b['send_s']:10.3f}s {b['total_s']:11.3f}s")
    out = REPO / "benchmarks" / "results" / "weight_sync.json"
    out.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
                               "threads": args.threads, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
