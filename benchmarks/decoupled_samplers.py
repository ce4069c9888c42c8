"""Decoupled mode on-policy (max_staleness 0): how long the trainer waits for each step's rollouts with one
sampler and with two, which share each step's chunks (one per trainer rank).

    python benchmarks/decoupled_samplers.py [--steps 8] [--repeats 2] [--ranks 2] [--completion 48]

Every run is `grpo train train.mode=decoupled` on a tiny random Qwen2 built here (no download), two trainer
ranks, one thread per process, so each sampler has a core of its own on a 2-core machine. The figure is the
median over steps 2.. of ``time/wait_for_rollout_s`` (the trainer's wait for a step's chunks: the step's
sampling time as the trainer sees it), then the median over repeats. Results:
benchmarks/results/decoupled_samplers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_model(folder: Path) -> Path:
    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer = build_tokenizer()
    build_qwen2(tokenizer, hidden_size=128, num_layers=4, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: Path, samplers: int, args) -> dict:
    """One decoupled run: per-step waits and chunk times from its metrics."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model.name_or_path={model}", "data.train=synthetic:seed=1,n=256", "data.eval=null",
            "train.mode=decoupled", f"decoupled.trainer_ranks={args.ranks}", f"decoupled.num_samplers={samplers}",
            f"decoupled.address=tcp://127.0.0.1:{free_port()}", "train.max_staleness=0",
            f"train.max_steps={args.steps}", "rollout.num_generations=8", f"rollout.max_completion_length={args.completion}",
            f"train.prompts_per_step={4 * args.ranks}", "train.micro_batch_size=16", "train.save_steps=1000",
            f"train.output_dir={out}/run", "log.report_to=[]", "log.progress_bar=false", "loss.beta=0",
        ]
        result = subprocess.run([sys.executable, "-m", "grpo", "train", str(REPO / "configs" / "smoke-cpu.yaml"),
                                 *overrides], cwd=REPO, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{samplers} sampler(s) failed:\n{result.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(out, "run", "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r and r["step"] >= 2]  # step 1 also waits for the samplers to load
    return {"wait_s": statistics.median(r["time/wait_for_rollout_s"] for r in rows),
            "chunk_s": statistics.median(r["sampler/seconds_per_chunk"] for r in rows),
            "samplers_per_step": statistics.mean(r["samplers/per_step"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "decoupled_samplers.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model(Path(folder))
        runs = {1: [], 2: []}
        for repeat in range(args.repeats):
            for samplers in (2, 1) if repeat % 2 else (1, 2):
                runs[samplers].append(run(model, samplers, args))
                print(f"  {samplers} sampler(s), run {repeat + 1}: {runs[samplers][-1]}", file=sys.stderr)
    median = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
    print(f"\n{'samplers':>8} {'wait per step (s)':>18} {'seconds per chunk':>18} {'samplers per step':>18}")
    for k, m in median.items():
        print(f"{k:>8} {m['wait_s']:>18.2f} {m['chunk_s']:>18.2f} {m['samplers_per_step']:>18.2f}")
    ratio = median[2]["wait_s"] / median[1]["wait_s"]
    print(f"\nwait with 2 samplers / with 1: {ratio:.2f} (ideal 0.5)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "trainer_ranks": args.ranks,
        "steps": args.steps, "repeats": args.repeats, "max_completion_length": args.completion,
        "median": {str(k): v for k, v in median.items()}, "wait_ratio_2_over_1": ratio, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
