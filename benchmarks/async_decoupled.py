"""Asynchronous decoupled mode on a long-tail recipe (issue 45): the trainer's wait per step, samples/s and held-out
accuracy after a fixed wall time, for (a) weights per chunk at max_staleness 1, (b) weights in flight, (c) in flight
+ partial rollouts, and (a) again at (c)'s max_staleness (the control).

    python benchmarks/async_decoupled.py --seeds 1 2 3 --wall-s 300      # the full run (about 17 min per seed)
    python benchmarks/async_decoupled.py --seeds 1 --wall-s 60            # a short check
    python benchmarks/async_decoupled.py --dry-run                        # the commands it would run

The recipe is configs/demo-cpu.yaml: the shipped assets/tiny-math on synthetic problems of one to three steps
(difficulty demo), whose completions run from about 20 to over 60 tokens, so a chunk's longest completion holds the
step. Every run is `grpo train ... train.mode=decoupled` with one trainer rank and two samplers (the launcher starts
them; one thread per process), stopped with Ctrl-C (SIGINT: the trainer checkpoints its last step) after --wall-s
seconds; `grpo eval` then scores that checkpoint greedily on held-out problems. Figures per run: the median
``time/wait_for_rollout_s`` over steps 2.. (step 1 also waits for the samplers to load), the completions trained per
second of wall time, the steps done, and the held-out accuracy; per variant the mean over seeds. (c) runs at
--partial-staleness (3 by default): a sampler runs a step ahead of the trainer and, one of two, continues its
carried groups every other step, so a carried token is about three versions old when its group is sent; at
max_staleness 1 most carried groups would start over (``rollout/partial_groups_restarted``, docs/guides/decoupled.md).
Results: benchmarks/results/async_decoupled.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo.config import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "demo-cpu.yaml"
HELD_OUT = "synthetic:seed=123,n={n},difficulty=demo"


def variants(args) -> dict[str, list[str]]:
    """The three settings compared, as overrides, and the control (c) needs: (a) at (c)'s max_staleness, which
    tells what the partial rollouts do from what the looser staleness bound does."""
    return {
        "a_per_chunk": ["decoupled.weight_update=per_chunk", "train.max_staleness=1"],
        "a_per_chunk_same_staleness": ["decoupled.weight_update=per_chunk",
                                       f"train.max_staleness={args.partial_staleness}"],
        "b_in_flight": ["decoupled.weight_update=in_flight", "train.max_staleness=1",
                        f"decoupled.inflight_check_tokens={args.check_tokens}"],
        "c_in_flight_partial": ["decoupled.weight_update=in_flight", f"train.max_staleness={args.partial_staleness}",
                                f"decoupled.inflight_check_tokens={args.check_tokens}",
                                "decoupled.partial_rollouts=true", f"decoupled.partial_token_budget={args.budget}"],
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(variant: list[str], seed: int, out: Path, args) -> list[str]:
    return [sys.executable, "-m", "grpo", "train", str(RECIPE), "train.mode=decoupled", "decoupled.trainer_ranks=1",
            "decoupled.num_samplers=2", f"decoupled.address=tcp://127.0.0.1:{free_port()}", "rollout.engine=hf",
            f"train.seed={seed}", f"train.output_dir={out}", "train.max_steps=100000", "train.save_steps=100000",
            "data.eval=null", "log.report_to=[]", "log.progress_bar=false", *variant, *args.extra]


def eval_command(out: Path, report: Path, args) -> list[str]:
    return [sys.executable, "-m", "grpo", "eval", str(out), "--data", HELD_OUT.format(n=args.eval_n),
            "--output", str(report), "--no-progress"]


def env() -> dict:
    src = str(REPO / "src")
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


def run_for(cmd: list[str], wall_s: float) -> float:
    """Run ``cmd`` for ``wall_s`` seconds, then Ctrl-C it (the trainer checkpoints); returns the seconds it ran."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.communicate(timeout=wall_s)
        raise SystemExit(f"the run ended before {wall_s} s (exit {proc.returncode}): {' '.join(cmd)}")
    except subprocess.TimeoutExpired:
        elapsed = time.perf_counter() - started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    if proc.returncode not in (0, 130):
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{err[-3000:]}")
    return elapsed


def measure(name: str, variant: list[str], seed: int, args, folder: Path) -> dict:
    """One run of a variant: its figures from metrics.jsonl and the held-out evaluation."""
    out, report = folder / f"{name}-seed{seed}", folder / f"{name}-seed{seed}-eval.json"
    elapsed = run_for(train_command(variant, seed, out, args), args.wall_s)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if len(rows) < 2:
        raise SystemExit(f"{name} seed {seed}: {len(rows)} steps in {args.wall_s} s; raise --wall-s")
    cfg = load_config(str(RECIPE), args.extra)
    G, P = cfg.rollout.num_generations, cfg.train.prompts_per_step
    completions = sum(len(r["groups"].split()) * G if "groups" in r else P * G for r in rows)  # partial: its groups
    result = subprocess.run(eval_command(out, report, args), cwd=REPO, env=env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"grpo eval of {out} failed:\n{result.stderr[-3000:]}")
    accuracy = held_out_accuracy(json.loads(report.read_text()))
    later = [r for r in rows if r["step"] >= 2]
    return {"seed": seed, "steps": len(rows), "wall_s": round(elapsed, 1),
            "wait_s": statistics.median(r["time/wait_for_rollout_s"] for r in later),
            "samples_per_s": completions / elapsed, "held_out_accuracy": accuracy,
            "staleness_token_mean": statistics.mean(r["staleness/token_mean"] for r in rows),
            "partial_groups_restarted": sum(r.get("rollout/partial_groups_restarted", 0.0) for r in rows)}


def held_out_accuracy(report: dict) -> float:
    """The greedy accuracy of a ``grpo eval --output`` report."""
    if "accuracy" not in report:
        raise SystemExit(f"no accuracy in the eval report: {sorted(report)}")
    return float(report["accuracy"])


def summary(runs: list[dict]) -> dict:
    keys = ("wait_s", "samples_per_s", "held_out_accuracy", "steps")
    return {k: statistics.mean(r[k] for r in runs) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--wall-s", type=float, default=300.0, help="training wall time per run")
    parser.add_argument("--partial-staleness", type=int, default=3, help="train.max_staleness of (c)")
    parser.add_argument("--budget", type=int, default=32, help="decoupled.partial_token_budget of (c)")
    parser.add_argument("--check-tokens", type=int, default=8, help="decoupled.inflight_check_tokens of (b), (c)")
    parser.add_argument("--eval-n", type=int, default=200, help="held-out problems")
    parser.add_argument("--variants", nargs="+", default=None, help="run only these (default: all four)")
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_decoupled.json"))
    args = parser.parse_args()
    if args.dry_run:
        folder = Path(tempfile.gettempdir()) / "async_decoupled-RUNS"
        for name, variant in variants(args).items():
            print(f"# {name} (each seed, {args.wall_s:.0f} s, then Ctrl-C)")
            print(" ".join(train_command(variant, args.seeds[0], folder / name, args)))
        print(" ".join(eval_command(folder / "RUN", folder / "eval.json", args)))
        return
    folder = Path(tempfile.mkdtemp(prefix="async_decoupled-"))  # the runs' folders, kept for a look afterwards
    chosen = {k: v for k, v in variants(args).items() if args.variants is None or k in args.variants}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for seed in args.seeds:  # the variants interleaved, so a slow spell of the machine hits them alike
        for name, variant in chosen.items():
            runs[name].append(measure(name, variant, seed, args, folder))
            print(f"{name} seed {seed}: {runs[name][-1]}", flush=True)
    means = {name: summary(r) for name, r in runs.items()}
    print(f"\n{'variant':<22}{'wait/step s':>12}{'samples/s':>11}{'held-out acc':>14}{'steps':>7}")
    for name, m in means.items():
        print(f"{name:<22}{m['wait_s']:>12.3f}{m['samples_per_s']:>11.2f}{m['held_out_accuracy']:>14.3f}"
              f"{m['steps']:>7.1f}")
    for control in ("a_per_chunk", "a_per_chunk_same_staleness"):
        if {control, "c_in_flight_partial"} <= set(means) and means[control]["wait_s"]:
            print(f"(c) wait / {control} wait: {means['c_in_flight_partial']['wait_s'] / means[control]['wait_s']:.3g}")
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "recipe": str(RECIPE.relative_to(REPO)), "seeds": args.seeds, "wall_s": args.wall_s,
              "partial_staleness": args.partial_staleness, "budget": args.budget, "check_tokens": args.check_tokens,
              "eval": HELD_OUT.format(n=args.eval_n), "extra": args.extra, "variants": chosen,
              "runs": runs, "means": means}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
