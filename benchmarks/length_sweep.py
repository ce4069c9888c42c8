"""The longest completion a training pass fits in a memory budget, with whole logits and with the fused LM head,
and ``grpo memory``'s estimate against each measured peak (about 3 minutes on a 2-core CPU).

The model of ``logprob_memory.py`` (Qwen2.5's 151,936-token vocabulary, a hidden-64 x 2-layer body, fp32,
CPU): one row of a 64-token prompt and L completion tokens, L = 256 .. 8,192, the training pass
(``completion_logprobs`` with grad, then backward), each in a fresh process, peak = the anonymous memory
above the pass's start. Estimated: ``estimate_memory``'s update components for the same shape and
``train.fused_lm_head`` (activations + logits + gradients; the weights and optimizer states are not
allocated by the pass). The whole-logits pass is not run where its estimate passes ``--cap-gib`` (this
machine's memory). Writes benchmarks/results/length_sweep.json.

    python benchmarks/length_sweep.py                 # budget 4 GiB
    python benchmarks/length_sweep.py --budget-gib 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))
from logprob_memory import QWEN_VOCAB, estimated_mib, run_case  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GIB, MIB = 1024**3, 1024**2
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
PROMPT = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--cap-gib", type=float, default=14.0, help="skip a run estimated above this")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=str(RESULTS / "length_sweep.json"))
    args = parser.parse_args()
    rows = []
    print(f"one row, {PROMPT} prompt + L completion tokens, vocabulary {QWEN_VOCAB}, hidden-64 x 2-layer body, fp32, "
          f"CPU ({os.cpu_count()} cores); training pass peak MiB, measured / grpo memory's estimate")
    print(f"{'L':>6}  {'whole logits':>24}  {'fused head':>24}")
    for length in LENGTHS:
        row = {"completion_tokens": length}
        for fused in (False, True):
            estimate = estimated_mib(rows=1, groups=1, prompt=PROMPT, completion=length, fused=fused)
            entry = {"estimated_mib": estimate}
            if estimate * MIB <= args.cap_gib * GIB:
                measured = run_case({"rows": 1, "groups": 1, "prompt": PROMPT, "completion": length, "reps": 1,
                                     "threads": args.threads, "device": "cpu", "body": "tiny", "pass": "training",
                                     "fused": fused})
                entry.update(measured_mib=measured["peak_mib"], seconds=measured["seconds"],
                             error=estimate / measured["peak_mib"] - 1)
            row["fused" if fused else "logits"] = entry
        rows.append(row)

        def cell(e: dict) -> str:
            if "measured_mib" not in e:
                return f"not run (est. {e['estimated_mib']:,.0f})"
            return f"{e['measured_mib']:,.0f} / {e['estimated_mib']:,.0f} ({e['error']:+.0%})"

        print(f"{length:>6}  {cell(row['logits']):>24}  {cell(row['fused']):>24}", flush=True)
    budget = args.budget_gib * GIB / MIB

    def longest(key: str) -> int | None:
        fitting = [r["completion_tokens"] for r in rows if r[key].get("measured_mib", float("inf")) <= budget]
        return max(fitting) if fitting else None

    report = {"machine": f"CPU, {os.cpu_count()} cores", "vocab_size": QWEN_VOCAB, "prompt_tokens": PROMPT,
              "model": "Qwen2, body hidden 64 x 2 layers, tied, random, fp32", "budget_gib": args.budget_gib,
              "longest_fitting": {"logits": longest("logits"), "fused": longest("fused")},
              "max_abs_error": max(abs(r[k]["error"]) for r in rows for k in ("logits", "fused") if "error" in r[k]),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"longest that fits {args.budget_gib:g} GiB (of {', '.join(map(str, LENGTHS))}): whole logits "
          f"{report['longest_fitting']['logits']}, fused head {report['longest_fitting']['fused']}; largest estimate "
          f"error {report['max_abs_error']:.0%}; written to {args.out}")


if __name__ == "__main__":
    main()
