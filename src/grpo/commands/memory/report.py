"""``grpo memory``: the estimate as a table or JSON."""

from __future__ import annotations

import json
import sys

from grpo.commands.memory.estimate import COMPONENTS, MemoryEstimate, estimate_memory
from grpo.commands.run_config import command_line_config


def format_table(estimate: MemoryEstimate) -> str:
    """A readable table: one row per component with how it was counted, the total, fits, notes."""
    a = estimate.assumptions
    title = (f"{a['model']}: {a['mode']}, {a['dtype']}, {estimate.gpus} GPU{'s' if estimate.gpus > 1 else ''}"
             + (f", ZeRO-{a['zero_stage']}" if a["zero_stage"] else "")
             + f", micro-batch {a['micro_batch_size']} x ({a['prompt_tokens']} + {a['completion_tokens']}) tokens")
    lines = [title, "", f"{'component':<12} {'GB/device':>10}  how"]
    for name in COMPONENTS:
        lines.append(f"{name:<12} {estimate.per_device_gb[name]:>10.2f}  {estimate.how.get(name, '')}")
    lines.append(f"{'total':<12} {estimate.total_gb:>10.2f}  peak phase: {estimate.peak_phase} "
                 f"({', '.join(f'{k} {v:.2f}' for k, v in estimate.phases_gb.items())} GB of tensors)")
    if estimate.fits is None:
        lines.append("fits: unknown (pass --gpu-gb)")
    else:
        verdict = "yes" if estimate.fits else "NO"
        lines.append(f"fits: {verdict} ({estimate.total_gb:.1f} of {estimate.gpu_gb:g} GB per device)")
    lines += ["", "GB = GiB (2^30 bytes)."] + [f"- {note}" for note in estimate.notes]
    return "\n".join(lines) + "\n"


def run_memory_command(config_path: str | None, overrides: list[str], gpus: int | None = None,
                       gpu_gb: float | None = None, json_output: bool = False, mixed_precision: bool | None = None,
                       vllm_gpu_memory_utilization: float | None = None) -> int:
    """Resolve the config (recipe, grpo's default one when None, + overrides) as ``grpo train`` does, estimate, print the table (or JSON); returns 0.

    The model's shape comes from model.name_or_path's config.json (a local folder or the HF cache) or
    the built-in table; otherwise a ConfigError names the key.
    """
    cfg = command_line_config(config_path, overrides)
    estimate = estimate_memory(cfg, gpus=gpus, gpu_gb=gpu_gb, mixed_precision=mixed_precision,
                               vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
    if json_output:
        sys.stdout.write(json.dumps(estimate.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_table(estimate))
    return 0
