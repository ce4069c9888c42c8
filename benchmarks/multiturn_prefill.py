"""Multi-turn rollouts with and without turn-to-turn KV reuse (issue 27): prompt tokens prefilled and wall time.

    python benchmarks/multiturn_prefill.py            # assets/tiny-math on this machine's CPU, P=8 x G=8, 3 turns
    python benchmarks/multiturn_prefill.py --engines hf --reps 3

A rollout as ``grpo.multiturn.driver`` runs one: turn 1 samples G completions per prompt, then every row that
ended its turn with an EOS gets a tool result (``--tool-tokens`` tokens, rendered as a chat turn) and samples
its next turn from prompt + its turns + the results, for ``--turns`` turns in all. "plain" prefills each
turn's whole conversation; "cached" runs the turns inside ``engine.cached_turns()`` so a row's next turn
prefills only its last sampled token and the tool result. Per engine and mode: prompt tokens fed to the
prefills (``fed``: padding included, what the model computes; ``real``: without padding), the seconds spent
in prefills (forward pre/post hooks) and per rollout (median of ``--reps``, after one warm-up rollout per
engine; on a shared CPU the wall seconds are noisy, ``cpu_s``, the process's CPU time, less so, the token
counts not at all), and whether the two modes drew the same tokens (same seeds). Numbers, no assertions.
Writes JSON (default benchmarks/results/multiturn_prefill.json).

On a GPU (``--device cuda``) the model's fp32 weights sample under bf16 autocast as in training (``hf``;
``hf-static`` samples its bf16 copy with the decode step in a CUDA graph), the prefill hooks synchronise, and
each mode records its peak GPU memory. bf16 kernels differ between a whole-conversation prefill and a cached
one, so the two modes may draw different tokens there. A model with random weights (the 1.5B benchmark
shape) seldom samples an EOS, so ``--continue-all`` gives every row its tool result and next turn whether its
turn ended or was cut at ``--max-tokens``:

    python benchmarks/multiturn_prefill.py --device cuda --reps 3
    python benchmarks/multiturn_prefill.py --device cuda --model /tmp/grpo-bench-model/qwen2.5-1.5b-random \
        --continue-all --prompts 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QUESTIONS = ["Tom has 12 apples and buys 7 more. How many apples?", "What is 48 + 24?", "A box holds 6 eggs. "
             "How many eggs are in 9 boxes?", "Sara had 30 dollars and spent 12. How much is left?",
             "What is 7 * 8?", "Ben reads 15 pages a day for 4 days. How many pages?", "What is 100 - 37?",
             "Each of 5 bags has 11 marbles. How many marbles?"]


class PrefillMeter:
    """Counts and times the model's prefill calls (those with ``logits_to_keep``; decode steps have none)."""

    def __init__(self, model, sync=lambda: None):
        self.fed = self.real = 0
        self.seconds = 0.0
        self._start = None
        self._sync = sync  # a GPU's kernels run after the call returns: wait for them at both ends
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after, with_kwargs=True)]

    def before(self, module, args, kwargs):
        if "logits_to_keep" in kwargs:
            ids = kwargs["input_ids"]
            self.fed += ids.numel()
            self.real += int(kwargs["attention_mask"][:, -ids.shape[1]:].sum())
            self._sync()
            self._start = time.perf_counter()

    def after(self, module, args, kwargs, output):
        if self._start is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def remove(self):
        for handle in self.handles:
            handle.remove()


def tool_result_ids(tokenizer, tokens: int) -> list[int]:
    """A tool turn of about ``tokens`` tokens (a user turn in the template's markup stands in for it)."""
    body = "<tool_response>\n"
    text = ""
    i = 0
    while True:
        text = f"<|im_start|>user\n{body}</tool_response><|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            return ids
        body += f"{(7 * i) % 10}"
        i += 1


def rollout(engine, tokenizer, prompts, args, cached: bool, seed: int):
    """One multi-turn rollout; the completion ids of every call."""
    from grpo.rollout import SamplingParams

    eos = tokenizer.eos_token_id
    tool = tool_result_ids(tokenizer, args.tool_tokens)
    with (engine.cached_turns() if cached else nullcontext(engine)) as turns:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out = turns.generate_ids(ids, SamplingParams(n=args.generations, max_tokens=args.max_tokens), seed=seed)
        rows = [ids[i // args.generations] for i in range(len(ids) * args.generations)]
        live = list(range(len(rows)))
        calls = [out.completion_ids.tolist()]
        for turn in range(1, args.turns):
            done = [out.completion_ids[j][out.completion_mask[j].bool()].tolist() for j in range(len(live))]
            live_next = [k for k, tokens in zip(live, done) if tokens and (args.continue_all or tokens[-1] == eos)]
            for k, tokens in zip(live, done):
                rows[k] = rows[k] + tokens
            if not live_next:
                break
            live = live_next
            for k in live:
                rows[k] = rows[k] + tool
            out = turns.generate_ids([rows[k] for k in live], SamplingParams(n=1, max_tokens=args.max_tokens),
                                     seed=seed + turn)
            calls.append(out.completion_ids.tolist())
    return calls


def run_engine(name: str, model, tokenizer, prompts, args) -> dict:
    import torch

    from grpo.rollout import LeanEngine, StaticEngine

    on_gpu = args.device.startswith("cuda")
    engine = {"hf": LeanEngine, "hf-static": StaticEngine}[name](model, tokenizer)
    sampling_model = engine.copy.model if name == "hf-static" else model
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def timed_rollout(cached: bool, seed: int):  # as training samples: fp32 weights under bf16 autocast on a GPU
        with torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else nullcontext():
            calls = rollout(engine, tokenizer, prompts, args, cached, seed=seed)
        sync()
        return calls

    result, tokens = {}, {}
    timed_rollout(False, seed=0)  # warm-up (and, for hf-static on a GPU, the graph capture)
    for mode in ("plain", "cached"):
        per_rollout, cpu, meters = [], [], []
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        for rep in range(1, args.reps + 1):
            meter = PrefillMeter(sampling_model, sync)
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens[mode, rep] = timed_rollout(mode == "cached", seed=rep)
            per_rollout.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            meter.remove()
            meters.append(meter)
        if on_gpu:  # above what was allocated before the mode's rollouts (the weights, the sampling copy)
            result[mode] = {"peak_gpu_mib": (torch.cuda.max_memory_allocated() - before) / 2**20}
        result[mode] = {**result.get(mode, {}),"seconds": statistics.median(per_rollout), "per_rollout_s": per_rollout,
                        "cpu_s": statistics.median(cpu),  # this process's CPU time: less hit by other load
                        # tokens: the last rollout's (each rep has its own seed)
                        "prefill_tokens_fed": meters[-1].fed, "prefill_tokens_real": meters[-1].real,
                        "prefill_s": statistics.median(m.seconds for m in meters),
                        "calls": len(tokens[mode, args.reps]),
                        "sampled_tokens": sum(1 for call in tokens[mode, args.reps] for row in call for t in row
                                              if t != tokenizer.pad_token_id)}
    result["same_tokens"] = all(tokens["plain", r] == tokens["cached", r] for r in range(1, args.reps + 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "assets" / "tiny-math"))
    parser.add_argument("--engines", default="hf,hf-static")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per turn")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--continue-all", action="store_true",
                        help="every row takes its next turn, ended by an EOS or cut at --max-tokens (random weights)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multiturn_prefill.json"))
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    questions = (QUESTIONS * (args.prompts // len(QUESTIONS) + 1))[:args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report = {"model": Path(args.model).name, "device": device, "threads": torch.get_num_threads(),
              "continue_all": args.continue_all,
              "torch": torch.__version__, "P": args.prompts, "G": args.generations, "turns": args.turns,
              "tool_tokens": len(tool_result_ids(tokenizer, args.tool_tokens)), "max_tokens_per_turn": args.max_tokens,
              "reps": args.reps, "engines": {}}
    for name in args.engines.split(","):
        if name not in ("hf", "hf-static"):
            parser.error(f"--engines: unknown engine {name!r}; known: hf, hf-static")
        report["engines"][name] = run_engine(name, model, tokenizer, prompts, args)
        print(f"{name}: {json.dumps(report['engines'][name])}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{report['model']}, P={args.prompts} x G={args.generations}, {args.turns} turns, "
          f"{report['tool_tokens']}-token tool results, {device}, {report['threads']} CPU threads, median of "
          f"{args.reps}" + (", every row continues" if args.continue_all else ""))
    on_gpu = args.device.startswith("cuda")
    print("| engine | mode | prefill tokens fed (real) | prefill s | rollout s | rollout CPU s | same tokens |"
          + (" peak GPU MiB |\n|---|---|---|---|---|---|---|---|" if on_gpu else "\n|---|---|---|---|---|---|---|"))
    for name, rows in report["engines"].items():
        for mode in ("plain", "cached"):
            row = rows[mode]
            print(f"| {name} | {mode} | {row['prefill_tokens_fed']:,} ({row['prefill_tokens_real']:,}) | "
                  f"{row['prefill_s']:.3f} | {row['seconds']:.3f} | {row['cpu_s']:.3f} | {rows['same_tokens']} |"
                  + (f" {row['peak_gpu_mib']:,.0f} |" if on_gpu else ""))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
