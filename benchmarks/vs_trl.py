"""grpo vs TRL's GRPOTrainer, side by side on this machine (``make bench``; ``--quick``: 2 minutes here).

Same model, prompts and settings for both (``harness.make_case``: G=8, 4 prompts per step,
max_completion_length 64, temperature 1.0, beta 0.04, loss_type "grpo", the same lr, no gradient
checkpointing; full fine-tuning and LoRA r=16; num_iterations 1 and 2). Each trainer runs in its own
process, alternating A B A B, with equal torch thread counts. Reported per case: median seconds per
step (one rollout batch) after warm-up, the generation / log-prob / optimisation split, peak RSS, the
mean reward over the last steps, and the achieved training FLOP/s against this machine's dense matmul
peak measured in the same run.
Writes benchmarks/results/vs_trl.json and vs_trl.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, make_case, prompt_token_counts, run_once  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def matmul_gflops(threads: int, size: int = 1024, seconds: float = 2.0) -> float:
    """Dense fp32 matmul throughput of this machine (the hardware ceiling we compare against)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - started) / 1e9


def build_models(workdir: Path) -> dict[str, Path]:
    """The shipped tiny default model (when present) and a tiny random Qwen2 with an 8192-token vocabulary."""
    from grpo.data import generate_problems
    from grpo.models.tiny import build_qwen2, build_tokenizer

    models = {}
    shipped = ROOT / "assets" / "tiny-math"
    if (shipped / "config.json").exists():
        models["tiny-math"] = shipped
    corpus = [e.question for e in generate_problems(3000, seed=7)] + [e.solution or "" for e in
                                                                      generate_problems(3000, seed=8)]
    tokenizer = build_tokenizer(corpus, vocab_size=8192)
    missing = 8192 - len(tokenizer)
    if missing > 0:  # the BPE may stop short of 8192 merges on this corpus: pad to the stated vocabulary
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    path = workdir / "random-qwen2-8k"
    build_qwen2(tokenizer, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    models["random-qwen2-8k"] = path
    return models


def write_prompts(workdir: Path, n: int) -> Path:
    from grpo.data import generate_problems, write_gsm8k_jsonl

    path = workdir / "prompts.jsonl"
    write_gsm8k_jsonl(generate_problems(n, seed=11), path)
    return path


def summarise(runs: list[dict], warmup: int, last: int) -> dict:
    def med(key):
        values = [v for r in runs for v in r[key][warmup:]]
        return statistics.median(values) if values else float("nan")

    rewards = [v for r in runs for v in r["reward"][-last:]]
    return {"s_per_step": med("step_s"), "generate_s": med("generate_s"), "logprobs_s": med("logprobs_s"),
            "train_s": med("train_s"), "final_reward": statistics.fmean(rewards) if rewards else float("nan"),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 cases, 5 steps, one repetition (about 2 minutes on 2 cores)")
    parser.add_argument("--steps", type=int, help="rollout steps per run (default 8, quick 5)")
    parser.add_argument("--reps", type=int, help="A/B repetitions per case (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="run only the cases whose name contains this (e.g. tiny-math/full); "
                                       "written to results/vs_trl-only.json, leaving the full results alone")
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 8)
    reps = args.reps or (1 if args.quick else 2)
    workdir = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    models = build_models(workdir)
    prompts = write_prompts(workdir, 400)
    peak = matmul_gflops(args.threads)
    cases = []
    for model_name, model in models.items():
        for lora_r in (0, 16):
            for mu in ((1,) if args.quick else (1, 2)):
                cases.append(make_case(model_name, model, prompts, lora_r=lora_r, num_iterations=mu, steps=steps,
                                       threads=args.threads))
    if args.quick and len(cases) > 2:
        cases = [c for c in cases if "lora16" not in c["name"] or "random" in c["name"]]
    if args.only:
        cases = [c for c in cases if args.only in c["name"]]
        if not cases:
            parser.error(f"--only {args.only!r} matches no case")
    rows = []
    for case in cases:
        ours, trl = [], []
        for _ in range(reps):  # A B A B
            ours.append(run_once("ours", case, workdir))
            trl.append(run_once("trl", case, workdir))
        a, b = summarise(ours, warmup=1, last=3), summarise(trl, warmup=1, last=3)
        row = {"name": case["name"], "ours_s_per_step": a["s_per_step"], "trl_s_per_step": b["s_per_step"],
               "speedup": b["s_per_step"] / a["s_per_step"], "ours_final_reward": a["final_reward"],
               "trl_final_reward": b["final_reward"], "ours_peak_rss_mb": a["peak_rss_mb"],
               "trl_peak_rss_mb": b["peak_rss_mb"],
               "split": {"ours": {k: a[k] for k in ("generate_s", "logprobs_s", "train_s")},
                         "trl": {k: b[k] for k in ("generate_s", "logprobs_s", "train_s")}},
               "train_gflops": train_gflops(case, ours)}
        rows.append(row)
        print(f"{row['name']:32} ours {row['ours_s_per_step']:.2f}s  trl {row['trl_s_per_step']:.2f}s  "
              f"speedup {row['speedup']:.2f}x  reward {row['ours_final_reward']:+.2f}/{row['trl_final_reward']:+.2f}",
              flush=True)
    report = {"machine": machine(args.threads), "cases": rows, "cpu_matmul_gflops": peak,
              "train_gflops": statistics.median(r["train_gflops"] for r in rows)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("vs_trl-only.json" if args.only else "vs_trl.json")).write_text(json.dumps(report, indent=2))
    print_table(report)
    if not args.only:
        plot(report, RESULTS / "vs_trl.png")


def train_gflops(case: dict, runs: list[dict]) -> float:
    """Achieved FLOP/s of our training forward+backward: 6 * params * tokens run / train seconds (full FT;
    LoRA skips the weight gradients: 4 * params * tokens). Tokens run per update: each distinct prompt
    once (the G completions of a group share its pass) plus every completion."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(case["model"]))
    params = sum(p.numel() for p in model.parameters())
    completion = statistics.fmean(v for r in runs for v in r["completion_length"])
    prompt = statistics.fmean(prompt_token_counts(case["model"], case["prompts"], case["P"] * case["steps"]))
    tokens = (case["P"] * prompt + case["P"] * case["G"] * completion) * case["num_iterations"]
    flops = (4 if case["lora_r"] else 6) * params * tokens
    train_s = statistics.median(v for r in runs for v in r["train_s"][1:])
    return flops / train_s / 1e9


def machine(threads: int) -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores ({threads} torch threads), " \
           f"torch {torch.__version__}, {platform.system()}"


def print_table(report: dict) -> None:
    print(f"\nmachine: {report['machine']}; dense matmul {report['cpu_matmul_gflops']:.1f} GFLOP/s; "
          f"training achieved {report['train_gflops']:.1f} GFLOP/s (median)")
    print(f"{'case':32} {'ours s/step':>11} {'TRL s/step':>10} {'speedup':>8} {'reward ours/TRL':>16} {'RSS MB':>13}")
    for r in report["cases"]:
        print(f"{r['name']:32} {r['ours_s_per_step']:11.2f} {r['trl_s_per_step']:10.2f} {r['speedup']:7.2f}x "
              f"{r['ours_final_reward']:+7.2f}/{r['trl_final_reward']:+6.2f} "
              f"{r['ours_peak_rss_mb']:6.0f}/{r['trl_peak_rss_mb']:5.0f}")


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 0.6 * len(report["cases"]) + 1.5))
    ax = fig.add_subplot()
    names = [r["name"] for r in report["cases"]]
    ax.barh(names, [r["speedup"] for r in report["cases"]], color="tab:green")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvline(1.5, color="tab:red", linestyle="--", linewidth=1, label="target 1.5x")
    ax.set_xlabel("speed-up over TRL GRPOTrainer (steps per second, higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
