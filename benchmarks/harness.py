"""What the grpo-vs-TRL benchmarks share: the case both trainers get, the child-process runner, medians.

``vs_trl.py`` (CPU, ``make bench``), ``gpu_vs_trl.py`` (one CUDA GPU, ``make bench-gpu``) and
``profile_step.py`` build their cases with ``make_case`` and run each trainer in a fresh process
with ``run_once`` (the child is ``runners.py``), so both sides always get the same settings.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "runners.py"


class ChildFailed(RuntimeError):
    """A trainer's child process exited non-zero; ``last_line`` is its error (the traceback's last line)."""

    def __init__(self, which: str, name: str, stderr: str):
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        self.last_line = lines[-1] if lines else "no output"
        super().__init__(f"{which} failed on {name}:\n{stderr[-4000:]}")


def make_case(model_name: str, model: Path, prompts: Path, *, lora_r: int, num_iterations: int, steps: int,
              threads: int, prompts_per_step: int = 4, num_generations: int = 8, max_completion_length: int = 64,
              micro_batch_size: int | None = None, gradient_checkpointing: bool = False, device: str = "cpu",
              bf16: bool = False, attn_implementation: str | None = None, beta: float = 0.04, lr: float = 1e-5,
              seed: int = 0, engine: str = "auto", vllm: bool = False) -> dict:
    """One benchmark case: every setting both trainers get (the defaults are the CPU benchmark's).

    micro_batch_size: completions per forward/backward; None = the whole step's P x G in one.
    engine: grpo's ``rollout.engine`` (TRL always samples with HF ``generate``).
    bf16: bf16 autocast over fp32 weights (grpo ``model.bf16``, TRL ``bf16=True``); for LoRA grpo keeps
    the frozen base in bf16 while TRL's stays fp32 under autocast (each trainer's own bf16 LoRA path).
    vllm: both sample with vLLM in the trainer's process (grpo ``rollout.engine: vllm``, TRL
    ``use_vllm=True, vllm_mode="colocate"``); needs the `vllm` extra and a GPU.
    """
    mode = ("lora16" if lora_r else "full") + ("+gc" if gradient_checkpointing else "") + ("+vllm" if vllm else "")
    completions = prompts_per_step * num_generations
    return {"name": f"{model_name}/{mode}/mu{num_iterations}", "model": str(model), "prompts": str(prompts),
            "lora_r": lora_r, "num_iterations": num_iterations, "G": num_generations, "P": prompts_per_step,
            "max_completion_length": max_completion_length, "micro_batch_size": micro_batch_size or completions,
            "gradient_checkpointing": gradient_checkpointing, "device": device, "bf16": bf16,
            "attn_implementation": attn_implementation, "beta": beta, "lr": lr, "steps": steps, "seed": seed,
            "threads": threads, "engine": engine, "vllm": vllm}


def run_once(which: str, case: dict, workdir: Path) -> dict:
    """Run one trainer (``ours`` or ``trl``) on ``case`` in a fresh process; its result dict (see runners.py).

    The child inherits this environment (a GPU machine's CUDA and library paths, PYTHONPATH entries of
    carried wheels) with this checkout's src/ first on PYTHONPATH and equal thread counts for both sides.
    Raises ChildFailed with the child's stderr when it exits non-zero.
    """
    tag = case["name"].replace("/", "_").replace("+", "_")
    case = dict(case, workdir=str(workdir / f"{which}-{tag}"), result=str(workdir / f"{which}-{tag}.json"))
    case_file = workdir / f"{which}-{tag}-case.json"
    case_file.write_text(json.dumps(case))
    env = {**os.environ, "OMP_NUM_THREADS": str(case["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HOME": str(workdir), "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(RUNNER), which, str(case_file)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise ChildFailed(which, case["name"], proc.stderr)
    return json.loads(Path(case["result"]).read_text())


def median_after(values: list[float], warmup: int) -> float:
    """Median of ``values[warmup:]`` (the steps after warm-up); NaN when none are left."""
    rest = values[warmup:]
    return statistics.median(rest) if rest else float("nan")


def prompt_token_counts(model: str, prompts: str, count: int) -> list[int]:
    """Chat-templated lengths (system prompt + question) of the first ``count`` prompts, which are the
    ones the runs trained on, step by step (``data.shuffle`` false, TRL ``shuffle_dataset=False``: in order)."""
    from grpo.data import load_dataset_source, resolve_system_prompt
    from grpo.models.loading import load_tokenizer
    from grpo.step.experience import render_prompts

    tokenizer = load_tokenizer(model)
    examples = load_dataset_source(prompts)[:count]
    texts = render_prompts(tokenizer, examples, resolve_system_prompt(None, "think"), 10**6)
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
