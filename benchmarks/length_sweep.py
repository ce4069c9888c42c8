"""The longest completion a training pass fits in a memory budget, with whole logits and with the fused LM head,
and ``grpo memory``'s estimate against each measured peak (about 3 minutes on a 2-core CPU).

The model of ``logprob_memory.py`` (Qwen2.5's 151,936-token vocabulary, tied; by default a hidden-64 x 2-layer
body, fp32, CPU): one row of a 64-token prompt and L completion tokens, L = 256 .. 8,192, the training pass
(``completion_logprobs`` with grad, then backward). On the CPU each (L, head) runs in a fresh process, peak =
the anonymous memory above the pass's start; the whole-logits pass is not run where its estimate passes
``--cap-gib`` (this machine's memory). On a GPU (``--device cuda``) each head runs one process over the
lengths in order (building the 1.5B body takes longer than a pass), peak = ``max_memory_allocated`` above
the start, and the first out-of-memory ends that head's sweep. Estimated: ``estimate_memory``'s update
components for the same shape and ``train.fused_lm_head`` (activations + logits + gradients, + autocast's bf16
weight copies on a GPU). A length fits when the pass's peak plus what full fine-tuning holds besides it (the
fp32 weights and AdamW's two states, ``resident_mib``; no reference copy, as with ``loss.beta`` 0) is within
``--budget-gib``. A single row has no padding, so the token budget and packing change nothing here; gradient
checkpointing does (``--gradient-checkpointing``). Writes benchmarks/results/length_sweep.json.

    python benchmarks/length_sweep.py                 # budget 4 GiB
    python benchmarks/length_sweep.py --budget-gib 8
    python benchmarks/length_sweep.py --device cuda --body 1.5b --budget-gib 80 \
        --lengths 1024,2048,4096,8192,16384,32768 [--gradient-checkpointing]   # issue 30: what fits in 80 GB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))
from logprob_memory import BODIES, QWEN_VOCAB, estimated_mib, resident_mib, run_case  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GIB, MIB = 1024**3, 1024**2
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
PROMPT = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--cap-gib", type=float, default=14.0, help="CPU: skip a run estimated above this")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="completion tokens, comma-separated")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--body", choices=list(BODIES), default="tiny", help="the model body under the real vocabulary")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="the body's layers checkpointed")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=str(RESULTS / "length_sweep.json"))
    args = parser.parse_args()
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",")})
    except ValueError:
        parser.error(f"--lengths {args.lengths!r}: comma-separated integers expected")
    on_gpu = args.device.startswith("cuda")
    gc = args.gradient_checkpointing
    base = {"rows": 1, "groups": 1, "prompt": PROMPT, "reps": 1, "threads": args.threads, "device": args.device,
            "body": args.body, "pass": "training", "gradient_checkpointing": gc}
    resident = resident_mib(body=args.body, device=args.device)
    hidden, layers = BODIES[args.body][:2]
    where = "CUDA, fp32 weights under bf16 autocast" if on_gpu else f"fp32, CPU ({os.cpu_count()} cores)"
    print(f"one row, {PROMPT} prompt + L completion tokens, vocabulary {QWEN_VOCAB}, hidden-{hidden} x {layers}-layer "
          f"body{', checkpointed' if gc else ''}, {where}; training pass peak MiB, measured / grpo memory's "
          f"estimate; weights + AdamW states besides it: {resident:,.0f} MiB")
    measured: dict[tuple[int, bool], dict] = {}
    for fused in (False, True):
        estimates = {L: estimated_mib(rows=1, groups=1, prompt=PROMPT, completion=L, fused=fused, body=args.body,
                                      device=args.device, gradient_checkpointing=gc) for L in lengths}
        if on_gpu:  # one process per head: the lengths in order, to the first out-of-memory
            for entry in run_case({**base, "fused": fused, "completions": lengths}):
                measured[entry["completion"], fused] = entry
        else:
            for L in lengths:
                if estimates[L] * MIB <= args.cap_gib * GIB:
                    (measured[L, fused],) = run_case({**base, "fused": fused, "completions": [L]})
        for L in lengths:
            entry = measured.setdefault((L, fused), {})
            entry["estimated_mib"] = estimates[L]
            if "peak_mib" in entry:
                entry["error"] = estimates[L] / entry["peak_mib"] - 1
            print(f"{'fused head' if fused else 'whole logits'} L={L}: {cell(entry)}", flush=True)
        report = sweep_report(args, lengths, measured, resident)  # after each head: a cut run keeps the first
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'L':>6}  {'whole logits':>30}  {'fused head':>30}")
    for row in report["rows"]:
        print(f"{row['completion_tokens']:>6}  {cell(row['logits']):>30}  {cell(row['fused']):>30}")
    error = f"largest estimate error {report['max_abs_error']:.0%}" if report["max_abs_error"] is not None else ""
    print(f"longest that fits {args.budget_gib:g} GiB with the weights and AdamW states (of "
          f"{', '.join(map(str, lengths))}): whole logits {report['longest_fitting']['logits']}, fused head "
          f"{report['longest_fitting']['fused']}; {error}; written to {args.out}")


def cell(entry: dict) -> str:
    """One measurement as the table shows it: measured / estimated MiB (error), or why there is none."""
    if entry.get("oom"):
        return f"out of memory (est. {entry['estimated_mib']:,.0f})"
    if "peak_mib" not in entry:
        return f"not run (est. {entry['estimated_mib']:,.0f})"
    return f"{entry['peak_mib']:,.0f} / {entry['estimated_mib']:,.0f} ({entry['error']:+.0%})"


def sweep_report(args: argparse.Namespace, lengths: list[int], measured: dict[tuple[int, bool], dict],
                 resident: float) -> dict:
    """The JSON of what ``measured`` holds so far ((L, fused) -> entry): a row per length, the longest that fits."""
    on_gpu = args.device.startswith("cuda")
    rows = [{"completion_tokens": L, **{"fused" if fused else "logits": {k: v for k, v in measured[L, fused].items()
                                                                          if k != "completion"}
                                        for fused in (False, True) if (L, fused) in measured}}
            for L in lengths]
    budget = args.budget_gib * GIB / MIB

    def longest(key: str) -> int | None:
        fitting = [r["completion_tokens"] for r in rows
                   if resident + r.get(key, {}).get("peak_mib", float("inf")) <= budget]
        return max(fitting) if fitting else None

    errors = [abs(r[k]["error"]) for r in rows for k in ("logits", "fused") if "error" in r.get(k, {})]
    machine = f"CPU, {os.cpu_count()} cores"
    if on_gpu:  # its name without a CUDA context in this process (the passes' process needs the memory)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True)
        machine = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "CUDA"
    return {"machine": machine, "device": args.device, "vocab_size": QWEN_VOCAB, "prompt_tokens": PROMPT,
            "model": f"Qwen2, body {args.body} {BODIES[args.body]} (hidden, layers, heads, KV heads, MLP), tied, "
                     "random, fp32" + (" under bf16 autocast" if on_gpu else ""),
            "gradient_checkpointing": args.gradient_checkpointing, "budget_gib": args.budget_gib,
            "resident_mib": resident, "longest_fitting": {"logits": longest("logits"), "fused": longest("fused")},
            "max_abs_error": max(errors) if errors else None, "rows": rows}


if __name__ == "__main__":
    main()
