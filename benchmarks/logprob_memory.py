"""The log-prob passes' peak memory and time with and without the fused LM head (``train.fused_lm_head``), at
Qwen2.5's vocabulary on a CPU (about 3 minutes on 2 cores).

A random Qwen2 with the real vocabulary (151,936, tied embeddings) and a small body (hidden 64, 2 layers,
fp32) so it runs here: the logits, not the body, are what the fused head removes. One micro-batch of
8 rows (two groups of 4 sharing a prompt) x 64 prompt + 1,024 completion tokens: the training pass
(``completion_logprobs`` with grad, then backward) and the reference pass (no grad), each with
``fused_head`` false (the logits path) and true, each in a fresh process. Measured: the peak of the
process's anonymous memory during the pass (``memory_check.AnonPeak``, glibc mapping every allocation of
64 KiB or more on its own, so memory follows the live tensors) minus its value just before it (model,
inputs and imports are in that baseline), and the pass's seconds (the best of ``--reps``); the training
pass also against ``grpo memory``'s estimate (``estimated_mib``). Writes benchmarks/results/logprob_memory.json.

    python benchmarks/logprob_memory.py                     # 8 x 1024 completion tokens
    python benchmarks/logprob_memory.py --completion 256    # other shapes
    python benchmarks/logprob_memory.py --device cuda --body 1.5b   # on a GPU: the Qwen2.5-1.5B body, fp32
        # weights under bf16 autocast as grpo trains; peak = torch.cuda.max_memory_allocated above the start
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1024**2
QWEN_VOCAB = 151936
BODIES = {  # (hidden, layers, heads, kv heads, MLP)
    "tiny": (64, 2, 4, 2, 128),
    "1.5b": (1536, 28, 12, 2, 8960),  # Qwen2.5-1.5B's
}


def estimated_mib(*, rows: int, groups: int, prompt: int, completion: int, fused: bool, body: str = "tiny",
                  device: str = "cpu", gradient_checkpointing: bool = False) -> float:
    """``grpo memory``'s estimate of the training pass of one micro-batch of ``rows`` (``groups`` distinct
    prompts) as ``child`` runs it: activations + logits + gradients (the weights and optimizer states are in
    the baseline), + autocast's bf16 weight copies on a GPU (made during the pass)."""
    est = _estimate(rows=rows, groups=groups, prompt=prompt, completion=completion, fused=fused, body=body,
                    device=device, gradient_checkpointing=gradient_checkpointing)
    gib = est.per_device_gb
    copies = est.assumptions["autocast_weight_copies_gb"]
    return (gib["activations"] + gib["logits"] + gib["gradients"] + copies) * 1024**3 / MIB


def resident_mib(*, body: str = "tiny", device: str = "cpu") -> float:
    """What full fine-tuning holds besides the training pass, by ``grpo memory``: the fp32 weights and AdamW's
    two fp32 states (the pass's own gradients are in its peak)."""
    est = _estimate(rows=1, groups=1, prompt=1, completion=1, fused=True, body=body, device=device)
    return (est.per_device_gb["weights"] + est.per_device_gb["optimizer"]) * 1024**3 / MIB


def _estimate(*, rows: int, groups: int, prompt: int, completion: int, fused: bool, body: str, device: str,
              gradient_checkpointing: bool = False):
    from transformers import Qwen2Config

    from grpo.config import load_config
    from grpo.commands.memory import estimate_memory

    hidden, layers, heads, kv_heads, mlp = BODIES[body]
    model_config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
                               tie_word_embeddings=True).to_dict()
    on_gpu = device.startswith("cuda")
    cfg = load_config(None, [f"model.name_or_path=qwen-vocab-{body}-body", f"train.micro_batch_size={rows}",
                             f"rollout.num_generations={max(2, rows // groups)}", f"train.prompts_per_step={groups}",
                             "loss.beta=0", f"data.max_prompt_length={prompt}",
                             f"rollout.max_completion_length={completion}", f"model.bf16={str(on_gpu).lower()}",
                             f"model.gradient_checkpointing={str(gradient_checkpointing).lower()}",
                             f"train.fused_lm_head={str(fused).lower()}", "rollout.engine=hf"])
    return estimate_memory(cfg, model_config=model_config, device="cuda" if on_gpu else "cpu")


def child(spec: dict) -> list[dict]:
    """The pass of ``spec`` at each of ``spec["completions"]`` (ascending) in this process, on one model:
    [{"completion", "peak_mib", "seconds", "logits_mib"}] (logits_mib: what one [b, L + 1, V] float32 logits
    tensor of the micro-batch would take). A CUDA out-of-memory ends the list with {"completion", "oom": True}:
    the longer ones would not fit either."""
    import torch

    from memory_check import AnonPeak, _status_kib
    from grpo.models.tiny import build_qwen2, build_tokenizer
    from grpo.step.logprobs import completion_logprobs

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    on_gpu = device.type == "cuda"
    tokenizer = build_tokenizer()  # ids only: the model's vocabulary is Qwen's
    hidden, layers, heads, kv_heads, mlp = BODIES[spec["body"]]
    rows, groups, Lp, completions = spec["rows"], spec["groups"], spec["prompt"], spec["completions"]
    model = build_qwen2(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                        intermediate_size=mlp, vocab_size=QWEN_VOCAB,
                        max_position_embeddings=max(16384, Lp + max(completions)), rope_theta=1e6, seed=0)
    model = model.to(device).train()
    if spec.get("gradient_checkpointing"):  # as grpo.models.loading enables it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grad = spec["pass"] == "training"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
    results = []
    for Lc in completions:  # the ids stay on the CPU, as a rollout hands them to the log-prob passes
        gen = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(3, QWEN_VOCAB, (groups, Lp), generator=gen).repeat_interleave(rows // groups, 0)
        completion_ids = torch.randint(3, QWEN_VOCAB, (rows, Lc), generator=gen)
        prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
        best, peak = float("inf"), 0
        try:
            for _ in range(spec["reps"]):
                model.zero_grad(set_to_none=True)
                if on_gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() if on_gpu else _status_kib("RssAnon") * 1024
                with contextlib.nullcontext() if on_gpu else AnonPeak() as watch:
                    started = time.perf_counter()
                    with torch.set_grad_enabled(grad), autocast:
                        logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                                       completion_mask, 1.0, fused_head=spec["fused"])
                        if grad:
                            logprobs.sum().backward()
                    if on_gpu:
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - started
                del logprobs
                top = torch.cuda.max_memory_allocated() if on_gpu else watch.peak
                best, peak = min(best, seconds), max(peak, top - before)
        except torch.cuda.OutOfMemoryError:
            results.append({"completion": Lc, "oom": True})
            break
        results.append({"completion": Lc, "peak_mib": peak / MIB, "seconds": best,
                        "logits_mib": rows * (Lc + 1) * QWEN_VOCAB * 4 / MIB})
    return results


def run_case(spec: dict) -> list[dict]:
    """``child`` in a fresh process (``spec["completions"]`` lengths), so each case starts from the same memory."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{spec}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2, help="distinct prompts (rows / groups share each)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--body", choices=list(BODIES), default="tiny", help="the model body under the real vocabulary")
    parser.add_argument("--out", default=str(RESULTS / "logprob_memory.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.rows % args.groups:
        parser.error(f"--groups {args.groups} must divide --rows {args.rows}")
    base = {"rows": args.rows, "groups": args.groups, "prompt": args.prompt, "completions": [args.completion],
            "reps": args.reps, "threads": args.threads, "device": args.device, "body": args.body}
    results = []
    hidden, layers = BODIES[args.body][:2]
    where = ("CUDA, fp32 weights under bf16 autocast" if args.device.startswith("cuda")
             else f"fp32, CPU ({os.cpu_count()} cores, {args.threads} threads)")
    print(f"Qwen2 body hidden {hidden} x {layers} layers, vocabulary {QWEN_VOCAB}, {where}; "
          f"{args.rows} rows x ({args.prompt} prompt + {args.completion} completion) tokens")
    print(f"{'pass':10} {'fused':6} {'peak MiB':>10} {'seconds':>8} {'grpo memory':>10}")
    for pass_name in ("training", "reference"):
        row = {"pass": pass_name}
        for fused in (False, True):
            (measured,) = run_case({**base, "pass": pass_name, "fused": fused})
            if measured.get("oom"):
                raise SystemExit(f"{pass_name} pass, fused head {fused}: out of GPU memory")
            estimate = ""
            if pass_name == "training":  # grpo memory sizes the training pass (the reference's is a rollout transient)
                measured["estimated_mib"] = estimated_mib(rows=args.rows, groups=args.groups, prompt=args.prompt,
                                                          completion=args.completion, fused=fused, body=args.body,
                                                          device=args.device)
                measured["error"] = measured["estimated_mib"] / measured["peak_mib"] - 1
                estimate = f" {measured['estimated_mib']:10.0f} ({measured['error']:+.1%})"
            row["fused" if fused else "logits"] = measured
            print(f"{pass_name:10} {str(fused):6} {measured['peak_mib']:10.0f} {measured['seconds']:8.2f}{estimate}",
                  flush=True)
        row["peak_ratio"] = row["logits"]["peak_mib"] / max(row["fused"]["peak_mib"], 1e-9)
        row["time_ratio"] = row["fused"]["seconds"] / row["logits"]["seconds"]
        results.append(row)
    import torch

    machine = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU, {os.cpu_count()} cores"
    report = {"machine": machine, "threads": args.threads, "vocab_size": QWEN_VOCAB, "device": args.device,
              "model": f"Qwen2, body {args.body} {BODIES[args.body]} (hidden, layers, heads, KV heads, MLP), tied, "
                       "random, fp32" + (" under bf16 autocast" if args.device.startswith("cuda") else ""),
              "shape": base, "one_logits_tensor_mib": results[0]["logits"]["logits_mib"], "passes": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for row in results:
        print(f"{row['pass']}: peak {row['logits']['peak_mib']:.0f} -> {row['fused']['peak_mib']:.0f} MiB "
              f"({row['peak_ratio']:.1f}x lower), time x{row['time_ratio']:.2f}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
