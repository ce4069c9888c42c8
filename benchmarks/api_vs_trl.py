"""The Python API end to end against TRL: examples/grpo_gsm8k_unsloth.py (the Unsloth GSM8K recipe, one
import line apart) run as a whole process under grpo and under TRL, on this machine.

    python benchmarks/api_vs_trl.py [--steps 20] [--repeats 3] [--threads 2]

Each run is a fresh process (imports, model and dataset loading, training, saving the adapter), the two
libraries alternating so that load from other processes hits both alike. The table gives each side's
median wall time of the whole process and of ``train()`` alone (TRL's and grpo's ``train_runtime``), and the
ratio TRL / grpo (> 1: grpo faster). Results: benchmarks/results/api_vs_trl.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "grpo_gsm8k_unsloth.py"


def run(side: str, steps: int, threads: int) -> dict:
    """One process of the example script: its wall time and its train_runtime."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(SCRIPT), "--max-steps", str(steps), "--output-dir", out]
        started = time.perf_counter()
        result = subprocess.run([*command, *(["--trl"] if side == "trl" else [])], cwd=REPO, env=env,
                                capture_output=True, text=True)
        wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{side} failed:\n{result.stderr[-3000:]}")
    entries = [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{")]
    summary = next(e for e in reversed(entries) if "train_runtime" in e and "step" in e)
    return {"wall_s": wall, "train_s": float(summary["train_runtime"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "api_vs_trl.json"))
    args = parser.parse_args()
    runs = {"grpo": [], "trl": []}
    for repeat in range(args.repeats):
        for side in ("trl", "grpo") if repeat % 2 else ("grpo", "trl"):
            runs[side].append(run(side, args.steps, args.threads))
            print(f"  {side} run {repeat + 1}: {runs[side][-1]}", file=sys.stderr)
    median = {side: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "train_s")}
              for side, rs in runs.items()}
    ratio = {k: median["trl"][k] / median["grpo"][k] for k in ("wall_s", "train_s")}
    print(f"examples/grpo_gsm8k_unsloth.py, {args.steps} steps (16 completions each, LoRA r=16, assets/tiny-math), "
          f"{args.threads} threads, median of {args.repeats}")
    print("| | TRL | grpo | TRL / grpo |\n|---|---|---|---|")
    for key, label in (("wall_s", "whole process (s)"), ("train_s", "train() (s)")):
        print(f"| {label} | {median['trl'][key]:.1f} | {median['grpo'][key]:.1f} | {ratio[key]:.2f}x |")
    import torch

    report = {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "runs": runs, "median": median,
              "trl_over_grpo": ratio, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
