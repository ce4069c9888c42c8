"""Check ``grpo memory`` against the measured peak memory of real GRPO steps on CPU (about 2 minutes).

Tiny random Qwen2 models (8192-token vocabulary, hidden 256 and 512, 4 layers) in fp32: full
fine-tuning and LoRA r=16, with and without gradient checkpointing. Each case runs one GRPO step of
``grpo.training.colocated.train`` in a fresh process: 4 prompts x G=2, micro-batch 4, ``loss.num_iterations``
2, so the second update's second micro-batch holds weights, AdamW states, gradients, activations
and logits at once, beside the reference copy (beta 0.04) - the sum the estimate models. Each
micro-batch holds two groups (the long and the short prompt), so its prompt is the longest length
the estimate assumes, and each group's rows share one prompt pass, as grpo.step.logprobs runs them.

Measured: the peak of the process's anonymous memory (``RssAnon`` in /proc/self/status, read every
5 ms by a thread) minus its value right after the policy was loaded (imports, tokenizer and data
are in the baseline). Anonymous memory is where tensors live; total RSS also counts file-backed
pages: transformers maps model.safetensors, so the policy's weights stay file-backed until the
first optimizer step writes them (a frozen LoRA base never is: its bytes are taken out of the
estimate for the comparison), and library code is paged in on first use of backward and AdamW.
Total RSS (``ru_maxrss`` minus ``VmRSS`` after the imports) is reported beside it.
Estimated: ``estimate_memory(cfg, device="cpu")``'s peak (no CUDA allowance). The activation check
subtracts the exactly known model states from the measured peak and compares the rest with the
estimated activations + logits.

The child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc maps every allocation of 64 KiB
or more on its own and unmaps it when freed: memory then follows the live tensors, as the CUDA
caching allocator's ``allocated`` does (``--glibc-default`` repeats one case without it, to show
what allocator caching adds). The two prompts have different lengths (left padding, hence a
padding mask, as with real data), and random models almost never stop early, so every completion is
``max_completion_length`` long, as the estimate assumes. Writes benchmarks/results/memory_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1024**2
COMPLETION_TOKENS = 32  # short: CPU sampling is slow; long prompts keep the activations large
QUESTIONS = [  # one long, one short: each step's two prompts are padded to the long one (a padding mask)
    " ".join(["A baker makes 24 loaves of bread every morning and sells them at the market for 3 dollars each."] * 16)
    + " How many dollars does she earn in a week?",
    "Tom has 12 apples and buys 7 more. How many apples does he have now?",
]


def build_models(workdir: Path) -> dict[str, Path]:
    """Tiny random Qwen2 models over one 8192-token byte-level BPE tokenizer."""
    from grpo.data import generate_problems
    from grpo.models.tiny import build_qwen2, build_tokenizer

    corpus = [e.question for e in generate_problems(3000, seed=7)] + [e.solution or "" for e in
                                                                      generate_problems(3000, seed=8)]
    tokenizer = build_tokenizer(corpus + QUESTIONS, vocab_size=8192)
    missing = 8192 - len(tokenizer)
    if missing > 0:  # the BPE may stop short of 8192 merges on this corpus: pad to the stated vocabulary
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    sizes = {"h256": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
             "h512": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536)}
    models = {}
    for name, size in sizes.items():
        path = workdir / name
        build_qwen2(tokenizer, seed=0, max_position_embeddings=1024, **size).save_pretrained(path)
        tokenizer.save_pretrained(path)
        models[name] = path
    return models


def write_prompts(workdir: Path) -> Path:
    path = workdir / "prompts.jsonl"
    with path.open("w") as handle:
        for k in range(16):
            handle.write(json.dumps({"question": QUESTIONS[k % 2], "answer": "#### 1"}) + "\n")
    return path


def longest_prompt(model_dir: Path, prompts: Path) -> int:
    """Tokens of the longest rendered prompt (system prompt + chat template), the estimate's prompt length."""
    from grpo.data import load_dataset_source, resolve_system_prompt
    from grpo.models.loading import load_tokenizer
    from grpo.step.experience import render_prompts

    tokenizer = load_tokenizer(str(model_dir))
    texts = render_prompts(tokenizer, load_dataset_source(str(prompts)), resolve_system_prompt(None, "think"), 10**6)
    return max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def overrides(model_dir: Path, prompts: Path, out: Path, prompt_len: int, lora_r: int, gc: bool) -> list[str]:
    values = {
        "model.name_or_path": str(model_dir), "model.lora_r": lora_r, "model.gradient_checkpointing": gc,
        "data.train": str(prompts), "data.shuffle": False, "data.max_prompt_length": prompt_len,
        "rollout.num_generations": 2, "rollout.max_completion_length": COMPLETION_TOKENS,
        "train.prompts_per_step": 4, "train.micro_batch_size": 4, "train.max_steps": 1, "train.save_steps": 1,
        "train.output_dir": str(out), "train.overwrite": True, "train.device": "cpu", "train.seed": 0,
        "loss.beta": 0.04, "loss.num_iterations": 2, "optim.learning_rate": 1e-5,
        "log.report_to": "[]", "log.progress_bar": False, "log.num_samples": 0,
    }
    return [f"{k}={v}" for k, v in values.items()]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class AnonPeak:
    """The largest RssAnon seen by a thread that reads /proc/self/status every ``interval_s``.

    Anonymous memory is where tensors live; total RSS also counts file-backed pages: the policy's
    safetensors file (transformers maps it, and the parameters stay file-backed until the first
    optimizer step writes them) and the library code paged in on first use of backward and AdamW.
    """

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon") * 1024)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def child(case_file: str) -> None:
    """Run the case's training in this process and write its measured memory (bytes) next to the case."""
    import resource

    # Everything train() imports, so that the baseline already holds the libraries.
    import matplotlib
    import matplotlib.pyplot  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import grpo.run.checkpoint
    import grpo.run.plots
    import grpo.run.progress
    import grpo.run.tracking
    import grpo.training.colocated
    from grpo.config import load_config

    case = json.loads(Path(case_file).read_text())
    cfg = load_config(None, case["overrides"])
    after_load: dict[str, int] = {}

    def baseline() -> None:
        # Imports, tokenizer, data and the model loaded (its weights are still file-backed).
        after_load["anon"] = _status_kib("RssAnon") * 1024

    baseline_rss = _status_kib("VmRSS") * 1024
    started = time.perf_counter()
    with AnonPeak() as anon:
        train_with_baseline(cfg, baseline)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(case["result"]).write_text(json.dumps({
        "baseline_anon": after_load["anon"], "peak_anon": anon.peak, "baseline_rss": baseline_rss,
        "peak_rss": peak_rss, "seconds": time.perf_counter() - started}))


def train_with_baseline(cfg, baseline) -> None:
    """``grpo.training.colocated.train(cfg)``, calling ``baseline()`` right after the policy is loaded: what a
    check measures is the memory above that point."""
    import grpo.training.colocated
    import grpo.training.prepare

    load_policy = grpo.training.prepare.policy_for  # prepare loads the policy for train

    def load_policy_then_baseline(*args, **kwargs):
        policy = load_policy(*args, **kwargs)
        baseline()
        return policy

    grpo.training.prepare.policy_for = load_policy_then_baseline
    try:
        grpo.training.colocated.train(cfg)
    finally:
        grpo.training.prepare.policy_for = load_policy


def run_child(script: str, case: dict, case_file: Path, env: dict) -> dict:
    """Run ``script --child`` on ``case`` in a fresh process; returns what the child measured."""
    case = dict(case, result=str(case_file.with_suffix(".out.json")))
    case_file.write_text(json.dumps(case))
    proc = subprocess.run([sys.executable, script, "--child", str(case_file)], env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{case['name']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(case["result"]).read_text())


def run_case(case: dict, workdir: Path, default_malloc: bool, threads: int) -> dict:
    case_file = workdir / f"{case['name'].replace('/', '_')}-{int(default_malloc)}.json"
    env = {"OMP_NUM_THREADS": str(threads), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HOME": str(workdir), "MPLBACKEND": "Agg"}
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return run_child(__file__, case, case_file, env)


def compare(case: dict, measured: dict) -> dict:
    """Relative errors (estimate - measured) / measured of the whole peak and of activations + logits.

    Measured: the peak of anonymous memory minus its value right after the policy was loaded. The
    total-RSS figure (ru_maxrss minus the RSS after imports) is kept for reference: it also counts
    file-backed pages (the mapped checkpoint, library code paged in during the step).
    """
    from grpo.config import load_config
    from grpo.commands.memory import estimate_memory

    cfg = load_config(None, case["overrides"])
    model_config = json.loads((Path(cfg.model.name_or_path) / "config.json").read_text())
    est = estimate_memory(cfg, model_config=model_config, device="cpu")
    gb = est.per_device_gb
    # A frozen LoRA base is never written, so on CPU it stays mapped from model.safetensors (file-backed
    # pages, not anonymous memory); on a GPU it is copied into device memory like any tensor.
    file_backed_mib = est.assumptions["params"] * 4 / MIB if cfg.model.lora_r else 0.0
    states_mib = (gb["weights"] + gb["gradients"] + gb["optimizer"] + gb["reference"]) * 1024 - file_backed_mib
    est_mib = est.total_gb * 1024 - file_backed_mib
    measured_mib = (measured["peak_anon"] - measured["baseline_anon"]) / MIB
    est_act_mib = (gb["activations"] + gb["logits"]) * 1024
    measured_act_mib = measured_mib - states_mib
    rss_mib = (measured["peak_rss"] - measured["baseline_rss"]) / MIB  # against the whole estimate
    return {"name": case["name"], "estimated_mib": est_mib, "measured_mib": measured_mib,
            "error": (est_mib - measured_mib) / measured_mib, "estimated_activations_mib": est_act_mib,
            "measured_activations_mib": measured_act_mib,
            "activation_error": (est_act_mib - measured_act_mib) / measured_act_mib,
            "states_mib": states_mib, "peak_phase": est.peak_phase,
            "components_mib": {k: v * 1024 for k, v in gb.items()},
            "total_rss_mib": rss_mib, "total_rss_error": (est.total_gb * 1024 - rss_mib) / rss_mib,
            "seconds": measured["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--glibc-default", action="store_true",
                        help="also run one case with glibc's default malloc, to see what allocator caching adds")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    workdir = Path(tempfile.mkdtemp(prefix="grpo-memory-check-"))
    models = build_models(workdir)
    prompts = write_prompts(workdir)
    prompt_len = longest_prompt(models["h512"], prompts)
    cases = []
    for model, lora_r, gc in (("h256", 0, False), ("h512", 0, False), ("h512", 16, False), ("h512", 0, True)):
        name = f"{model}/{'lora16' if lora_r else 'full'}{'/gc' if gc else ''}"
        cases.append({"name": name, "overrides": overrides(models[model], prompts, workdir / name.replace('/', '_'),
                                                           prompt_len, lora_r, gc)})
    print(f"prompt {prompt_len} + completion {COMPLETION_TOKENS} tokens, micro-batch 4, fp32, "
          f"{args.threads} threads; MiB of anonymous memory above the loaded model", flush=True)
    rows = []
    for case in cases:
        row = compare(case, run_case(case, workdir, default_malloc=False, threads=args.threads))
        rows.append(row)
        print(f"{row['name']:14} measured {row['measured_mib']:6.1f}  estimated {row['estimated_mib']:6.1f} "
              f"({row['error']:+6.1%})   activations+logits {row['measured_activations_mib']:6.1f} vs "
              f"{row['estimated_activations_mib']:6.1f} ({row['activation_error']:+6.1%})   total RSS "
              f"{row['total_rss_mib']:6.1f} ({row['total_rss_error']:+6.1%})  [{row['seconds']:.0f}s]", flush=True)
    report = {"prompt_tokens": prompt_len, "completion_tokens": COMPLETION_TOKENS, "micro_batch": 4,
              "dtype": "fp32", "malloc": "MALLOC_MMAP_THRESHOLD_=65536", "cases": rows,
              "max_abs_error": max(abs(r["error"]) for r in rows),
              "max_abs_activation_error": max(abs(r["activation_error"]) for r in rows)}
    if args.glibc_default:
        glibc = compare(cases[1], run_case(cases[1], workdir, default_malloc=True, threads=args.threads))
        report["default_malloc"] = glibc
        print(f"{glibc['name']:14} with glibc's default malloc: measured {glibc['measured_mib']:.1f} MiB, "
              f"estimate {glibc['error']:+.1%} (allocator caching)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_check.json").write_text(json.dumps(report, indent=2))
    print(f"\nlargest error: whole peak {report['max_abs_error']:.1%}, activations + logits "
          f"{report['max_abs_activation_error']:.1%}; written to {RESULTS / 'memory_check.json'}")


if __name__ == "__main__":
    main()
