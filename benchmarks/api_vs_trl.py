"""The Python API end to end against TRL: short TRL 1.16 scripts, one import line apart, each run as a whole
process under grpo and under TRL on this machine.

    python benchmarks/api_vs_trl.py [--cases gsm8k-unsloth text-prompts tools-lora] [--repeats 3] [--threads 2]
    python benchmarks/api_vs_trl.py --dry-run          # the commands it would run

The cases (``CASES``): examples/grpo_gsm8k_unsloth.py (the Unsloth GSM8K notebook's recipe: chat prompts, five
rewards, LoRA) at 3 steps, as a notebook user runs many short ``train()`` calls, and at 20;
benchmarks/scripts/text_prompts.py (TRL's quickstart shape: text prompts, the model by its path) at 3;
benchmarks/scripts/tools_lora.py (``tools=[calculator]``, LoRA, ``num_iterations=2``) at 4 optimizer updates.
Each run is a fresh process (imports, model and dataset loading, training, whatever the script saves), the
two libraries alternating so that load from other processes hits both alike. For each case the table gives
each side's median wall time of the whole process and of ``train()`` alone (``train_runtime``), and the ratio
TRL / grpo (> 1: grpo faster), and train() per sampled token (the two sides draw different
completions, whose lengths a short script does not average out). A case that fails on one side is reported with its error and the others still
run. The load average before and after is recorded: figures taken beside other work are only indicative.
Results: benchmarks/results/api_vs_trl.json.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("grpo", "trl")
TIMES = ("wall_s", "train_s")


@dataclass(frozen=True)
class Case:
    """One script at one length; ``steps`` is its ``--max-steps`` (TRL's optimizer updates)."""

    name: str
    script: Path
    steps: int
    args: tuple[str, ...] = ()  # the script's own options (a recipe)


CASES = [  # the short ones first: the JSON is written after each case
    Case("gsm8k-unsloth", REPO / "examples" / "grpo_gsm8k_unsloth.py", 3),
    Case("text-prompts", REPO / "benchmarks" / "scripts" / "text_prompts.py", 3),
    Case("tools-lora", REPO / "benchmarks" / "scripts" / "tools_lora.py", 4),  # num_iterations=2: 2 generations
    Case("gsm8k-unsloth", REPO / "examples" / "grpo_gsm8k_unsloth.py", 20),
    # TRL's loss-variant recipes (issue 58): the fields grpo refused before, at 4 optimizer updates
    *(Case(recipe, REPO / "benchmarks" / "scripts" / "loss_variants.py", 4, ("--recipe", recipe))
      for recipe in ("gspo", "dapo-80-20", "cispo", "sapo", "no-save", "sync-ref", "optimizers")),
]


class CaseFailed(Exception):
    pass


def command(case: Case, side: str, out: str) -> list[str]:
    return [sys.executable, str(case.script), "--max-steps", str(case.steps), "--output-dir", out, *case.args,
            *(["--trl"] if side == "trl" else [])]


def run(case: Case, side: str, threads: int) -> dict:
    """One process of the script: its wall time and its train_runtime (from the printed log_history)."""
    # Bytecode caching on, as a user has it: with PYTHONDONTWRITEBYTECODE (set in some sandboxes) grpo's source would
    # be compiled in every process while TRL's site-packages come precompiled (0.2-0.3 s here).
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = subprocess.run(command(case, side, out), cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
    if result.returncode != 0:
        last = [line for line in result.stderr.splitlines() if line.strip()][-1:] or ["(no stderr)"]
        raise CaseFailed(f"{side} exited with {result.returncode}: {last[0]}")
    entries = [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{")]
    summary = next((e for e in reversed(entries) if "train_runtime" in e and "step" in e), None)
    if summary is None:
        raise CaseFailed(f"{side} printed no log_history summary (train_runtime)")
    if summary["step"] != case.steps:
        raise CaseFailed(f"{side} ended at global_step {summary['step']}, not {case.steps}")
    # The sampled tokens trained on (mean completion length summed over the logged updates, the model's tokens
    # only, as both log it): the two sides draw different samples, so a script whose lengths vary with the draw
    # (a tool call or not) can give one side more to train on; train() per token compares like with like.
    lengths = [float(e["completions/mean_length"]) for e in entries  # log_history's (TRL also prints its logs)
               if "completions/mean_length" in e and "step" in e]
    keys = sorted({k for e in entries if "step" in e for k in e})  # every key log_history holds
    return {"wall_s": wall, "train_s": float(summary["train_runtime"]), "mean_length_sum": sum(lengths), "keys": keys}


def time_case(case: Case, repeats: int, threads: int) -> dict:
    """Both sides ``repeats`` times, alternating which goes first; their medians and TRL / grpo."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    try:
        for repeat in range(repeats):
            for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                runs[side].append(run(case, side, threads))
                shown = {k: v for k, v in runs[side][-1].items() if k != "keys"}
                print(f"  {case.name} {case.steps} steps, {side} run {repeat + 1}: {shown}", file=sys.stderr)
    except CaseFailed as failure:
        print(f"  {case.name} {case.steps} steps: {failure}", file=sys.stderr)
        return {"runs": runs, "error": str(failure)}
    median = {side: {k: statistics.median(r[k] for r in rs) for k in TIMES} for side, rs in runs.items()}
    per_token = {side: statistics.median(r["train_s"] / r["mean_length_sum"] for r in rs if r["mean_length_sum"])
                 for side, rs in runs.items()}
    # TRL's log keys grpo's log_history lacks (a field grpo maps but does not report shows here)
    missing = sorted(set().union(*(r["keys"] for r in runs["trl"])) - set().union(*(r["keys"] for r in runs["grpo"])))
    return {"runs": runs, "median": median, "median_train_s_per_length": per_token, "trl_keys_grpo_lacks": missing,
            "trl_over_grpo": {**{k: median["trl"][k] / median["grpo"][k] for k in TIMES},
                              "train_s_per_length": per_token["trl"] / per_token["grpo"]}}


def table(results: list[dict]) -> str:
    lines = ["| script | steps | TRL process (s) | grpo process (s) | TRL / grpo | TRL train() (s) | grpo train() (s) "
             "| TRL / grpo | sampled tokens TRL / grpo | train() per token TRL / grpo | TRL keys grpo lacks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['steps']} | failed: {r['error']} |")
            continue
        m, ratio = r["median"], r["trl_over_grpo"]
        lines.append(f"| {r['case']} | {r['steps']} | {m['trl']['wall_s']:.1f} | {m['grpo']['wall_s']:.1f} | "
                     f"{ratio['wall_s']:.2f}x | {m['trl']['train_s']:.1f} | {m['grpo']['train_s']:.1f} | "
                     f"{ratio['train_s']:.2f}x | {_length_ratio(r):.2f} | {ratio['train_s_per_length']:.2f}x | "
                     f"{', '.join(r.get('trl_keys_grpo_lacks', [])) or 'none'} |")
    return "\n".join(lines)


def _length_ratio(result: dict) -> float:
    """TRL's sampled tokens over grpo's (medians over the runs): above 1, TRL's train() had more to train on."""
    return (statistics.median(r["mean_length_sum"] for r in result["runs"]["trl"])
            / statistics.median(r["mean_length_sum"] for r in result["runs"]["grpo"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted({c.name for c in CASES})
    parser.add_argument("--cases", nargs="+", choices=names, default=names)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "api_vs_trl.json"))
    args = parser.parse_args()
    cases = [c for c in CASES if c.name in args.cases]
    if args.dry_run:
        for case in cases:
            for side in SIDES:
                print(" ".join(command(case, side, "OUT")))
        return
    import torch

    report = {"repeats": args.repeats, "threads": args.threads, "cases": [],
              "load_average_1min": {"before": os.getloadavg()[0]},
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        report["cases"].append({"case": case.name, "script": str(case.script.relative_to(REPO)), "steps": case.steps,
                                **time_case(case, args.repeats, args.threads)})
        report["load_average_1min"]["after"] = os.getloadavg()[0]
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # a run cut short keeps its cases
    load = report["load_average_1min"]
    print(f"{args.threads} threads, median of {args.repeats}, load average {load['before']:.1f} -> "
          f"{load['after']:.1f} ({os.cpu_count()} CPUs)")
    print(table(report["cases"]))


if __name__ == "__main__":
    main()
