"""What an in-training evaluation costs beside a training step, on the demo recipe (configs/demo-cpu.yaml).

Each case runs `grpo train` on the demo recipe for a few steps, evaluating before the first step and after the
last (``train.eval_steps`` past the run), and reads ``time/eval_s`` and ``time/step_s`` from metrics.jsonl:
the cost of one evaluation in training steps. Run it on a quiet machine (the figures are wall times).

    python benchmarks/eval_cost.py [--steps 4] [--engine hf-static] [--out benchmarks/results/eval_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_SETS = "{demo: 'synthetic:seed=123,n=%d,difficulty=demo', medium: 'synthetic:seed=321,n=%d,difficulty=medium'}"
CASES = [  # (label, set sizes, eval.num_samples)
    ("shipped demo recipe", None, None),
    ("demo 500 + medium 200, k=4", (500, 200), 4),
    ("demo 500 + medium 200, greedy", (500, 200), 1),
]


def run_case(sizes: tuple[int, int] | None, samples: int | None, steps: int, engine: str, folder: Path,
             batch_size: int | None = None) -> dict:
    overrides = [f"eval.batch_size={batch_size}"] if batch_size else []
    overrides += [f"train.max_steps={steps}", f"train.eval_steps={steps + 1}", "train.save_steps=1000",
                 f"train.output_dir={folder}", f"rollout.engine={engine}", "log.progress_bar=false",
                 "log.report_to=[]", "log.num_samples=0"]
    if sizes is not None:
        overrides += [f"data.eval={DEMO_SETS % sizes}", f"eval.num_samples={samples}"]
    done = subprocess.run([sys.executable, "-m", "grpo", "train", "configs/demo-cpu.yaml", *overrides], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"grpo train failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [r["time/eval_s"] for r in rows if "time/eval_s" in r]
    steps_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    metrics = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith(("_ci_low", "_ci_high"))})
    step = statistics.median(steps_s)
    return {"eval_s": evals, "step_s_median": step, "eval_per_step": [e / step for e in evals],
            "metrics_logged": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engine", default="hf-static")
    parser.add_argument("--case", action="append", default=[],
                        help="extra case DEMO_N,MEDIUM_N,K (repeatable), e.g. 64,32,4")
    parser.add_argument("--batch-size", type=int, default=None, help="eval.batch_size (default: the recipe's)")
    parser.add_argument("--only-extra", action="store_true", help="run the --case cases only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "eval_cost.json")
    args = parser.parse_args()
    cases = ([] if args.only_extra else CASES) + [(f"demo {d} + medium {m}, k={k}", (d, m), k)
                     for d, m, k in (tuple(int(x) for x in c.split(",")) for c in args.case)]
    results = []
    print(f"{'case':40} {'one evaluation (s)':>22} {'step (s)':>9} {'/ step':>12}")
    for label, sizes, samples in cases:
        with tempfile.TemporaryDirectory() as tmp:
            r = run_case(sizes, samples, args.steps, args.engine, Path(tmp) / "run", args.batch_size)
        results.append({"case": label, "sizes": sizes, "num_samples": samples, **r})
        print(f"{label:40} {', '.join(f'{e:.2f}' for e in r['eval_s']):>22} {r['step_s_median']:9.2f} "
              f"{', '.join(f'{x:.2f}x' for x in r['eval_per_step']):>12}")
    args.out.write_text(json.dumps({"machine": f"CPU, {os.cpu_count()} cores", "engine": args.engine, "eval_batch_size": args.batch_size,
                                    "steps": args.steps, "cases": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
