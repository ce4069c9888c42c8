"""Sampling speed in isolation: grpo's engines against HF ``generate`` with its dynamic cache (TRL's path
without vLLM), one process, one model, the same prompts.

    python benchmarks/generation_speed.py                 # CUDA, Qwen2.5-1.5B shape, 16 x 8 x 256, full and LoRA
    python benchmarks/generation_speed.py --tiny          # the same code on a CPU in seconds (tested)

Issue 14's target: ``hf-static`` >= 3x ``generate`` (dynamic cache) at 16 x 8 x 256 on the 1.5B shape,
full and LoRA alike. The model is random (Qwen2.5 shape, grpo.models.tiny.build_qwen2 with the
gpu_vs_trl shapes), so completions run to ``max_new_tokens`` (a random model practically never samples
EOS: the worst case, equal for every engine). The policy is held as training holds it (fp32 weights,
on CUDA under bf16 autocast for the engines that sample from it directly); ``generate`` runs over a bf16
copy (its best case); ``hf-static`` makes its own bf16 copy, and its time includes refreshing it.
Per engine: the median of ``--reps`` calls after one warm-up call (each call's seconds too: prompt widths
grow by 3 tokens per call, as steps' widths vary), tokens/s, and the ratio to generate.
Writes JSON (default benchmarks/results/generation_speed.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> tuple[list[float], object]:
    """Seconds of each of ``reps`` calls after a warm-up call (``fn(call_index)``), and the last result."""
    fn(0)
    times, result = [], None
    for rep in range(1, reps + 1):
        sync(device)
        start = time.perf_counter()
        result = fn(rep)
        sync(device)
        times.append(time.perf_counter() - start)
    return times, result


def build(shape: str, device: str, lora: bool):
    import torch
    from gpu_vs_trl import SHAPES

    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer = build_tokenizer()
    policy = build_qwen2(tokenizer, seed=0, rope_theta=1e6, max_position_embeddings=4096, **SHAPES[shape]).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        with torch.no_grad():  # a trained adapter is not zero
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=1e-3)
    return tokenizer, policy


def prompts_for(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens (the GSM8K prompts' ~140 in the default)."""
    words = "Natalia sold clips to 48 of her friends in April and then she sold half as many clips in May".split()
    out = []
    for i in range(count):
        text, n = f"Question {i}:", 0
        while n < tokens:
            text += " " + words[(i + n) % len(words)]
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(text)
    return out


def run_case(args, lora: bool) -> dict:
    import torch

    from grpo.rollout import HFEngine, LeanEngine, SamplingParams, StaticEngine

    device = "cpu" if args.tiny else "cuda"
    tokenizer, policy = build(args.shape, device, lora)
    # Each call's prompts are a few tokens longer than the last, as training steps' prompt widths differ:
    # an engine whose kernels are planned per shape pays for every new width (the 2x jumps between
    # identical steps on the H100 may be that: cuDNN attention built a plan per new shape there).
    prompts = [prompts_for(tokenizer, args.prompts, args.prompt_tokens + 3 * call) for call in range(args.reps + 1)]
    params = SamplingParams(n=args.generations, max_tokens=args.max_new_tokens, temperature=1.0)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext())
    bf16_model = (copy.deepcopy(policy).merge_and_unload() if lora else copy.deepcopy(policy))
    if device == "cuda":
        bf16_model = bf16_model.to(torch.bfloat16)
    engines = {
        "generate (dynamic cache, bf16 copy)": lambda c: HFEngine(bf16_model, tokenizer).generate(prompts[c], params,
                                                                                                 seed=c),
        "hf (policy under autocast)": lambda c: _under(autocast, LeanEngine(policy, tokenizer).generate, prompts[c],
                                                       params, seed=c),
    }
    static = StaticEngine(policy, tokenizer)
    engines["hf-static"] = lambda c: static.generate(prompts[c], params, seed=c)
    rows = {}
    for name, fn in engines.items():
        per_call, gen = timed(lambda c, fn=fn: _under(attention_context(args.sdpa_backends), fn, c), device, args.reps)
        seconds = statistics.median(per_call)
        tokens = int(gen.completion_mask.sum())
        rows[name] = {"seconds": seconds, "per_call_s": per_call, "tokens": tokens, "tokens_per_s": tokens / seconds}
        print(f"{'lora' if lora else 'full':4} {name:38} {seconds:8.3f} s  {tokens / seconds:10,.0f} tok/s  "
              f"(calls: {', '.join(f'{t:.2f}' for t in per_call)})", flush=True)
    base = rows["generate (dynamic cache, bf16 copy)"]["seconds"]
    for row in rows.values():
        row["speedup_vs_generate"] = base / row["seconds"]
    rows["hf-static"]["graph_failure"] = static.graph_failure
    del policy, bf16_model, static
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _under(context, fn, *args, **kwargs):
    with context:
        return fn(*args, **kwargs)


def attention_context(names: str):
    """``--sdpa-backends``: those attention backends in that order (the values of ``model.sdpa_backends``, which a
    training run applies to its passes), or torch's choice."""
    from grpo.models.loading import sdpa_backends, sdpa_context

    return sdpa_context(sdpa_backends(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="1.5b", choices=("0.5b", "1.5b", "3b", "7b"))
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on a CPU (a smoke run of this code)")
    parser.add_argument("--prompts", type=int, help="P (default 16; --tiny 2)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, help="L (default 256; --tiny 12)")
    parser.add_argument("--prompt-tokens", type=int, default=140)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default="full,lora")
    parser.add_argument("--sdpa-backends", default="auto",
                        help="attention backends in order, e.g. efficient,math or cudnn,efficient (flash takes no "
                             "padding mask); auto: torch's choice")
    parser.add_argument("--out", help="results JSON (default benchmarks/results/generation_speed[-tiny].json)")
    args = parser.parse_args()
    try:
        attention_context(args.sdpa_backends)
    except ValueError as err:
        parser.error(f"--sdpa-backends: {err}")
    args.shape = "tiny" if args.tiny else args.shape
    args.prompts = args.prompts or (2 if args.tiny else 16)
    args.max_new_tokens = args.max_new_tokens or (12 if args.tiny else 256)
    if args.tiny:
        args.prompt_tokens = min(args.prompt_tokens, 30)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU is visible: this benchmark is for a GPU; --tiny runs its code on a CPU")
    report = {"device_name": torch.cuda.get_device_name() if not args.tiny else "cpu", "shape": args.shape,
              "P": args.prompts, "G": args.generations, "max_new_tokens": args.max_new_tokens,
              "torch": torch.__version__, "sdpa_backends": args.sdpa_backends, "cases": {}}
    for case in args.cases.split(","):
        if case not in ("full", "lora"):
            parser.error(f"--cases: unknown case {case!r}; known: full, lora")
        report["cases"][case] = run_case(args, lora=case == "lora")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "generation_speed-tiny.json" if args.tiny else "generation_speed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\n| case | engine | s | tokens/s | x generate |\n|---|---|---|---|---|")
    for case, rows in report["cases"].items():
        for name, row in rows.items():
            print(f"| {case} | {name} | {row['seconds']:.3f} | {row['tokens_per_s']:,.0f} | "
                  f"{row['speedup_vs_generate']:.2f}x |")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
