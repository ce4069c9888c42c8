"""token_logprobs forward + backward: the row loop against the chunked autograd Function (seconds).

    python benchmarks/token_logprobs_speed.py [--device cuda] [--threads 1]

Shapes: B=8, T=64 at V=518 (``make demo``'s) and 8192 (the GSM8K tokenizer's); on CUDA also
B=16, T=257, V=151936 (a Qwen2.5 micro-batch's completion logits). fp32 and bf16 logits,
temperature 1 and 0.7. Each cell is the fastest of ``--reps`` runs (loop and chunked interleaved,
so load from other processes hits both alike), with peak CUDA memory beside it on a GPU.
token_logprobs picks the loop on a CPU and the chunked Function on a GPU by default; here both are
forced (``chunk_tokens`` set for the chunked one), so the choice can be re-checked on any machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo.algorithm.tokens import _CHUNK_ELEMENTS, _row_loop_logprobs, token_logprobs


def timed(fn, logits, ids, weights, temperature, device) -> tuple[float, float]:
    x = logits.clone().requires_grad_(True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    (fn(x, ids, temperature) * weights).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    return time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(8, 64, 518), (8, 64, 8192)] + ([(16, 257, 151936)] if args.device == "cuda" else [])
    gen = torch.Generator().manual_seed(0)
    for B, T, V in shapes:
        chunk = max(1, _CHUNK_ELEMENTS // V)
        fns = {"loop": lambda x, i, t: _row_loop_logprobs(x, i[:, 1:], t),
               "chunked": lambda x, i, t: token_logprobs(x, i, t, chunk_tokens=chunk)}
        for dtype in (torch.float32, torch.bfloat16):
            for temperature in (1.0, 0.7):
                logits = torch.randn(B, T, V, generator=gen).to(args.device, dtype)
                ids = torch.randint(0, V, (B, T), generator=gen).to(args.device)
                weights = torch.randn(B, T - 1, generator=gen).to(args.device)
                best = {name: (float("inf"), 0.0) for name in fns}
                for _ in range(args.reps):
                    for name, fn in fns.items():
                        best[name] = min(best[name], timed(fn, logits, ids, weights, temperature, args.device))
                cells = ", ".join(f"{name} {s * 1e3:.2f} ms" + (f" (peak {mb:.0f} MiB)" if mb == mb else "")
                                  for name, (s, mb) in best.items())
                print(f"B={B} T={T} V={V} {str(dtype).removeprefix('torch.')} T={temperature}: {cells}", flush=True)


if __name__ == "__main__":
    main()
