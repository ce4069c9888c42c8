"""Check ``grpo memory`` against ``torch.cuda.max_memory_allocated`` of real GRPO steps on a GPU.

The CUDA counterpart of ``memory_check.py`` (same prompts, tokenizer and step shape: 4 prompts x G=2,
micro-batch 4 of two groups, ``loss.num_iterations`` 2, beta 0.04 with a reference copy), on a model with the body
of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864; random weights, the 8192-token
test vocabulary) and longer completions. Cases: full fine-tuning fp32 and bf16, LoRA r=16 over a bf16
base, and full fp32 with gradient checkpointing. Each case runs ``grpo.training.colocated.train`` in a fresh
process; measured = peak allocated bytes minus the bytes allocated right after the policy was loaded
(the policy's weights), estimated = the estimate's tensors at its peak phase (without the CUDA
context/fragmentation allowance, which ``max_memory_allocated`` does not see) minus the same weights.
The peak is also taken phase by phase (``PhasePeaks``: rollout, update, optimizer step) against the
estimate's phases, and the activation check (the update's peak minus the exactly known states, against
the estimated activations + logits) reads the update phase, whichever phase holds the run's peak.

    python benchmarks/memory_check_gpu.py      # about 2 minutes on one GPU; writes results/memory_check_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_check import QUESTIONS, longest_prompt, overrides, run_child, write_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1024**2
COMPLETION_TOKENS = 128
QWEN05_BODY = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)


def build_model(workdir: Path) -> Path:
    from grpo.data import generate_problems
    from grpo.models.tiny import build_qwen2, build_tokenizer

    corpus = [e.question for e in generate_problems(3000, seed=7)] + [e.solution or "" for e in
                                                                      generate_problems(3000, seed=8)]
    tokenizer = build_tokenizer(corpus + QUESTIONS, vocab_size=8192)
    missing = 8192 - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    path = workdir / "qwen05-body"
    build_qwen2(tokenizer, seed=0, max_position_embeddings=2048, **QWEN05_BODY).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def case_overrides(model: Path, prompts: Path, out: Path, prompt_len: int, lora_r: int, gc: bool, bf16: bool):
    values = overrides(model, prompts, out, prompt_len, lora_r, gc)
    values = [v for v in values if not v.startswith(("train.device=", "rollout.max_completion_length="))]
    return values + ["train.device=cuda", f"model.bf16={bf16}", f"rollout.max_completion_length={COMPLETION_TOKENS}"]


class PhasePeaks:
    """Peak memory per phase of a grpo run: at each mark, the peak since the previous mark is the named
    phase's (a phase's peak is the largest of its spans). Marks: each update's start closes the
    ``rollout`` (sampling, rewards, reference log-probs), each optimizer step's start closes the
    ``update`` (the micro-batches' forward/backward), its end the ``optimizer_step``, and the run's end
    ``after_training`` (final evaluation, saving). ``start`` (right after the policy is loaded) takes
    the baseline. ``peak``/``reset``/``allocated``: the allocator's counters (CUDA's in the check)."""

    def __init__(self, peak, reset, allocated):
        self.peak, self.reset, self.allocated = peak, reset, allocated
        self.baseline: int | None = None
        self.phases: dict[str, int] = {}
        self.order: list[str] = []

    def start(self) -> None:
        self.baseline = self.allocated()
        self.reset()

    def mark(self, phase: str) -> None:
        self.phases[phase] = max(self.phases.get(phase, 0), self.peak())
        self.order.append(phase)
        self.reset()


def train_with_phase_peaks(cfg, peaks: PhasePeaks) -> None:
    """``grpo.training.colocated.train(cfg)`` with ``peaks`` marked at its phase boundaries (see ``PhasePeaks``)."""
    import torch.optim.optimizer as optim_hooks

    import grpo.training.colocated
    import grpo.training.loop
    import grpo.training.prepare

    # prepare loads the policy for train
    load_policy, train_on_batch = grpo.training.prepare.policy_for, grpo.training.loop.train_on_batch

    def load_policy_then_start(*args, **kwargs):
        policy = load_policy(*args, **kwargs)
        peaks.start()
        return policy

    def update(*args, **kwargs):
        peaks.mark("rollout")
        return train_on_batch(*args, **kwargs)

    hooks = [optim_hooks.register_optimizer_step_pre_hook(lambda *_: peaks.mark("update")),
             optim_hooks.register_optimizer_step_post_hook(lambda *_: peaks.mark("optimizer_step"))]
    grpo.training.prepare.policy_for, grpo.training.loop.train_on_batch = load_policy_then_start, update
    try:
        grpo.training.colocated.train(cfg)
        peaks.mark("after_training")
    finally:
        grpo.training.prepare.policy_for, grpo.training.loop.train_on_batch = load_policy, train_on_batch
        for hook in hooks:
            hook.remove()


def child(case_file: str) -> None:
    import torch

    from grpo.config import load_config

    case = json.loads(Path(case_file).read_text())
    cfg = load_config(None, case["overrides"])
    peaks = PhasePeaks(torch.cuda.max_memory_allocated, torch.cuda.reset_peak_memory_stats,
                       torch.cuda.memory_allocated)
    started = time.perf_counter()
    train_with_phase_peaks(cfg, peaks)
    torch.cuda.synchronize()
    Path(case["result"]).write_text(json.dumps({
        "baseline": peaks.baseline, "peak": max(peaks.phases.values()), "phase_peaks": peaks.phases,
        "reserved_peak": torch.cuda.max_memory_reserved(), "seconds": time.perf_counter() - started,
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}))


def run_case(case: dict, workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    return run_child(__file__, case, workdir / f"{case['name'].replace('/', '_')}.json", env)


def compare(case: dict, measured: dict) -> dict:
    from grpo.config import load_config
    from grpo.commands.memory import estimate_memory

    cfg = load_config(None, case["overrides"])
    model_config = json.loads((Path(cfg.model.name_or_path) / "config.json").read_text())
    est = estimate_memory(cfg, model_config=model_config, device="cuda")
    gb = est.per_device_gb
    tensors_mib = (est.total_gb - gb["overhead"]) * 1024
    # the policy's own weights were allocated before the baseline; autocast's bf16 copies come after it
    weights_mib = (gb["weights"] - est.assumptions["autocast_weight_copies_gb"]) * 1024
    est_mib = tensors_mib - weights_mib
    measured_mib = (measured["peak"] - measured["baseline"]) / MIB
    # each phase's peak against the estimate's phase (both above the loaded policy's weights)
    phases = {phase: {"estimated_mib": est.phases_gb[phase] * 1024 - weights_mib,
                      "measured_mib": (peak - measured["baseline"]) / MIB}
              for phase, peak in measured["phase_peaks"].items() if phase in est.phases_gb}
    for row in phases.values():
        row["error"] = (row["estimated_mib"] - row["measured_mib"]) / row["measured_mib"]
    # Activations + logits at the update phase's peak, whichever phase is the run's: the states held then
    # (gradients, AdamW states, the reference, autocast's copies) are known exactly. (Taken at the run's
    # peak instead, an optimizer-step peak made the H200 check's checkpointing case read -59%: the foreach
    # AdamW's temporaries counted as activations.)
    states_mib = (gb["gradients"] + gb["optimizer"] + gb["reference"] + est.assumptions["autocast_weight_copies_gb"]) * 1024
    est_act = (gb["activations"] + gb["logits"]) * 1024
    measured_act = phases["update"]["measured_mib"] - states_mib
    measured_peak_phase = max(phases, key=lambda phase: phases[phase]["measured_mib"])
    return {"name": case["name"], "estimated_mib": est_mib, "measured_mib": measured_mib,
            "error": (est_mib - measured_mib) / measured_mib, "estimated_activations_mib": est_act,
            "measured_activations_mib": measured_act, "activation_error": (est_act - measured_act) / measured_act,
            "peak_phase": est.peak_phase, "measured_peak_phase": measured_peak_phase, "phases": phases,
            "components_mib": {k: v * 1024 for k, v in gb.items()},
            "reserved_peak_mib": measured["reserved_peak"] / MIB, "seconds": measured["seconds"],
            "gpu": measured["gpu"], "torch": measured["torch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    workdir = Path(tempfile.mkdtemp(prefix="grpo-memory-check-gpu-"))
    model = build_model(workdir)
    prompts = write_prompts(workdir)
    prompt_len = longest_prompt(model, prompts)
    cases = []
    for lora_r, gc, bf16 in ((0, False, False), (0, False, True), (16, False, True), (0, True, False)):
        name = f"{'lora16' if lora_r else 'full'}/{'bf16' if bf16 else 'fp32'}{'/gc' if gc else ''}"
        cases.append({"name": name, "overrides": case_overrides(model, prompts, workdir / name.replace("/", "_"),
                                                                prompt_len, lora_r, gc, bf16)})
    print(f"Qwen2.5-0.5B body, vocab 8192; prompt {prompt_len} + completion {COMPLETION_TOKENS} tokens, "
          f"micro-batch 4; MiB allocated above the loaded policy", flush=True)
    rows = []
    for case in cases:
        row = compare(case, run_case(case, workdir))
        rows.append(row)
        print(f"{row['name']:16} measured {row['measured_mib']:8.1f}  estimated {row['estimated_mib']:8.1f} "
              f"({row['error']:+6.1%})   activations+logits {row['measured_activations_mib']:7.1f} vs "
              f"{row['estimated_activations_mib']:7.1f} ({row['activation_error']:+6.1%})  peak phase "
              f"{row['measured_peak_phase']} (estimated {row['peak_phase']})  [{row['seconds']:.0f}s]", flush=True)
        print("                 " + ", ".join(f"{phase} {r['measured_mib']:.0f} vs {r['estimated_mib']:.0f} "
                                              f"({r['error']:+.1%})" for phase, r in row["phases"].items()), flush=True)
    report = {"model": "Qwen2.5-0.5B body (random), vocab 8192", "prompt_tokens": prompt_len,
              "completion_tokens": COMPLETION_TOKENS, "micro_batch": 4, "cases": rows,
              "max_abs_error": max(abs(r["error"]) for r in rows),
              "max_abs_activation_error": max(abs(r["activation_error"]) for r in rows)}
    out = Path(os.environ.get("OUT", RESULTS))
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_check_gpu.json").write_text(json.dumps(report, indent=2))
    print(f"\nlargest error: whole peak {report['max_abs_error']:.1%}, activations + logits "
          f"{report['max_abs_activation_error']:.1%}")


if __name__ == "__main__":
    main()
