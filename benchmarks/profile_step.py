"""Where one of our training steps spends its time: ``python benchmarks/profile_step.py [--model
random-qwen2-8k] [--lora] [--mu 2]``.

Runs the benchmark's case (the same model, prompts and settings as ``vs_trl.py``) for a few steps under
``torch.profiler`` and prints the operators by self CPU time and the per-phase split from the run's
metrics. This is how the issue-6 speed work found its targets (see docs/benchmarks.md, "Speed against TRL").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import runners  # noqa: E402
import vs_trl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-math", choices=["tiny-math", "random-qwen2-8k"])
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 instead of full fine-tuning")
    parser.add_argument("--mu", type=int, default=1, help="num_iterations")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    args = parser.parse_args()
    torch.set_num_threads(2)
    workdir = Path(tempfile.mkdtemp(prefix="grpo-profile-"))
    models = vs_trl.build_models(workdir)
    case = harness.make_case(args.model, models[args.model], vs_trl.write_prompts(workdir, 400),
                             lora_r=16 if args.lora else 0, num_iterations=args.mu, steps=args.steps, threads=2)
    case["workdir"] = str(workdir / "run")
    torch.manual_seed(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = runners.run_ours(case)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(json.dumps({k: round(statistics.median(v[1:]), 3) for k, v in result.items()
                      if k.endswith("_s")}, indent=1), "(median seconds per step after the first, under the profiler)")


if __name__ == "__main__":
    main()
