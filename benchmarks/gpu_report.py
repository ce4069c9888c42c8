"""``gpu_vs_trl.py``'s results: per-side summaries (medians after warm-up), the markdown table, ``--merge``.

Three sides can run per case: ``grpo`` and ``trl`` (whole training steps), and ``plain``: a plain
forward+backward loop over the same tokens with the same model setup (``runners.run_plain``), the floor
grpo's update is held to (issue 15: grpo's update within 1.25x of it, the GPU busy >= 85% of the update).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from harness import ROOT, median_after

SIDE_NAMES = ("grpo", "trl", "plain")


def step_flops(case: dict, params: tuple[int, int], prompt_tokens: float, completion_tokens: float) -> float:
    """Model FLOPs of one update over a step's P x G completions: 6 x matmul parameters x tokens trained
    (4 x for LoRA: frozen weights get no weight gradient), every completion with its own prompt, as both
    trainers' losses see them (grpo runs each shared prompt once per group, which is its saving, not extra
    work); the output head only at completion positions."""
    body, head = params
    factor = 4 if case["lora_r"] else 6
    return factor * case["P"] * case["G"] * (body * (prompt_tokens + completion_tokens) + head * completion_tokens)


PROFILE_KEYS = ("update_gpu_busy", "update_profiled_s", "update_kernels", "update_top_ops_host",
                "update_top_ops_gpu")  # runners.profile_update's


def profile_keys(result: dict) -> dict:
    return {key: result[key] for key in PROFILE_KEYS if result.get(key) is not None}


def profile_tables(report: dict) -> str:
    """Each profiled update's operator tables (text), by case and side: where the update's time went."""
    parts = []
    for row in report["cases"]:
        for side in ("grpo", "plain"):
            s = ok(row, side)
            if s and "update_top_ops_host" in s:
                parts.append(f"## {row['case']}, {side}: one update, {s.get('update_kernels', '?')} kernels, GPU busy "
                             f"{100 * s.get('update_gpu_busy', float('nan')):.0f}%\n\nby self host time\n"
                             f"{s['update_top_ops_host']}\nby self GPU time\n{s.get('update_top_ops_gpu', '-')}")
    return "\n\n".join(parts)


def side_summary(result: dict, case: dict, prompt_tokens: list[int], params: tuple[int, int]) -> dict:
    """Medians over steps 2..N of one trainer's run (an ``error`` entry when it crashed)."""
    if "error" in result:
        return {"error": result["error"]}
    P, G = case["P"], case["G"]
    gen_rate, tflops, other = [], [], []
    for i, completion in enumerate(result["completion_length"]):
        prompt = statistics.fmean(prompt_tokens[i * P:(i + 1) * P])  # step i trains prompts i*P .. i*P+P-1
        gen_rate.append(P * G * completion / result["generate_s"][i])
        tflops.append(step_flops(case, params, prompt, completion) / result["train_s"][i] / 1e12)
        other.append(result["step_s"][i] - result["generate_s"][i] - result["ref_logprobs_s"][i]
                     - result["train_s"][i])
    summary = {key: median_after(result[key], 1) for key in ("step_s", "generate_s", "ref_logprobs_s", "train_s")}
    summary.update({"other_s": median_after(other, 1), "generated_tokens_per_s": median_after(gen_rate, 1),
                    "update_tflops": median_after(tflops, 1), "completion_length": median_after(
                        result["completion_length"], 1), "reward": statistics.fmean(result["reward"]),
                    "peak_rss_gb": result["peak_rss_mb"] / 1024, "steps": len(result["step_s"]),
                    "per_step": {k: result[k] for k in ("step_s", "generate_s", "ref_logprobs_s", "train_s")}})
    summary.update(profile_keys(result))  # grpo on CUDA: extra steps' updates, profiled
    if result.get("eval_s"):  # each evaluation's seconds; the last ran after the steps, warm, against a step's
        summary.update(eval_s=result["eval_s"], eval_over_step=result["eval_s"][-1] / summary["step_s"])
    if "peak_gpu_mb" in result:
        summary["peak_gpu_gb"] = result["peak_gpu_mb"] / 1024
    for key in ("moe_aux_loss", "moe_routing_mismatch"):  # a MoE policy's router loss, replay's mismatch: per step
        if key in result:
            summary[key] = result[key]
    return summary


def plain_summary(result: dict, case: dict, params: tuple[int, int]) -> dict:
    """Medians over updates 2..N of the plain loop (``runners.run_plain``; an ``error`` entry when it crashed)."""
    if "error" in result:
        return {"error": result["error"]}
    flops = step_flops(case, params, result["mean_prompt_tokens"], result["completion_tokens"])
    summary = {"train_s": median_after(result["train_s"], 1), "steps": len(result["train_s"]),
               "update_tflops": flops / median_after(result["train_s"], 1) / 1e12,
               "peak_rss_gb": result["peak_rss_mb"] / 1024, "per_step": {"train_s": result["train_s"]}}
    summary.update(profile_keys(result))
    if "peak_gpu_mb" in result:
        summary["peak_gpu_gb"] = result["peak_gpu_mb"] / 1024
    return summary


def progress_line(name: str, side: str, s: dict) -> str:
    if "error" in s:
        return f"{name:32} {side:5} crashed: {s['error']}"
    memory = f"peak GPU {s['peak_gpu_gb']:.1f} GB" if "peak_gpu_gb" in s else f"peak RSS {s['peak_rss_gb']:.2f} GB"
    busy = f", GPU busy {100 * s['update_gpu_busy']:.0f}% of an update" if "update_gpu_busy" in s else ""
    if side == "plain":
        return f"{name:32} {side:5} update {s['train_s']:.2f} s, {s['update_tflops']:.3g} TFLOP/s{busy}, {memory}"
    return (f"{name:32} {side:5} {s['step_s']:7.2f} s/step (generate {s['generate_s']:.2f}, ref log-probs "
            f"{s['ref_logprobs_s']:.2f}, update {s['train_s']:.2f}) {s['update_tflops']:.3g} TFLOP/s{busy}, {memory}")


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)
    except OSError:  # no git on the machine (a copied working tree)
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def cell(row: dict, side: str, key: str, fmt: str) -> str:
    """One side's value in a table cell: "-" when that side did not run (or lacks the value), "crash"
    when it crashed."""
    s = row.get(side)
    if s is None:
        return "-"
    if "error" in s:
        return "crash"
    return format(s[key], fmt) if key in s else "-"


def pair(row: dict, key: str, fmt: str) -> str:
    return f"{cell(row, 'grpo', key, fmt)} / {cell(row, 'trl', key, fmt)}"


def tflops_cell(row: dict, side: str, peak: float) -> str:
    value = cell(row, side, "update_tflops", ".3g")
    s = row.get(side)
    return value if not s or "error" in s else f"{value} ({100 * s['update_tflops'] / peak:.0f}%)"


def ok(row: dict, side: str) -> dict | None:
    s = row.get(side)
    return s if s and "error" not in s else None


def update_vs_plain(row: dict) -> str:
    """grpo's update seconds over the plain loop's (issue 15's target: <= 1.25), TRL's after it."""
    plain = ok(row, "plain")
    if not plain:
        return "-"
    ratios = [f"{s['train_s'] / plain['train_s']:.2f}x" if s else "-" for s in (ok(row, "grpo"), ok(row, "trl"))]
    return f"{plain['train_s']:.2f} s: {ratios[0]} / {ratios[1]}"


def busy_cell(row: dict) -> str:
    """The share of an update's wall time the GPU ran kernels: grpo / plain loop (issue 15: >= 85%)."""
    cells = [f"{100 * s['update_gpu_busy']:.0f}%" if s and "update_gpu_busy" in s else "-"
             for s in (ok(row, "grpo"), ok(row, "plain"))]
    return " / ".join(cells)


def markdown_table(report: dict) -> str:
    """The report as a header line and a markdown table (README-ready), then any crashes' errors."""
    peak, settings, versions = report["matmul_peak_tflops"], report["settings"], report["versions"]
    on_gpu = settings["device"].startswith("cuda")
    memory, mem_key = ("peak GPU GB", "peak_gpu_gb") if on_gpu else ("peak RSS GB", "peak_rss_gb")
    family = "Qwen3-MoE" if report["shape"].get("family") == "qwen3_moe" else "Qwen2.5"
    lines = [
        f"{report['device_name']}; torch {versions['torch']}, transformers {versions['transformers']}, "
        f"TRL {versions['trl']}, grpo {report['grpo_commit']}; {family}-{report['shape_name']} shape, random "
        f"weights; P={settings['P']} x G={settings['G']}, {settings['max_new_tokens']} new tokens, micro-batch "
        f"{settings['micro_batch_size']}, median of steps 2-{settings['steps']}; {report['matmul_dtype']} "
        f"matmul peak {peak:.3g} TFLOP/s",
        "",
        "| case | grpo s/step | TRL s/step | TRL / grpo | generate s grpo / TRL | ref log-probs s grpo / TRL "
        "| update s grpo / TRL | update: plain fwd+bwd s: grpo / TRL over it | GPU busy in update grpo / plain "
        f"| generated tok/s grpo / TRL | update TFLOP/s grpo / TRL (% of peak) | {memory} grpo / TRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["cases"]:
        g, t = ok(row, "grpo"), ok(row, "trl")
        ratio = f"**{t['step_s'] / g['step_s']:.2f}x**" if g and t else "-"
        lines.append(
            f"| {row['case']} | {cell(row, 'grpo', 'step_s', '.2f')} | {cell(row, 'trl', 'step_s', '.2f')} "
            f"| {ratio} | {pair(row, 'generate_s', '.2f')} | {pair(row, 'ref_logprobs_s', '.2f')} "
            f"| {pair(row, 'train_s', '.2f')} | {update_vs_plain(row)} | {busy_cell(row)} "
            f"| {pair(row, 'generated_tokens_per_s', ',.0f')} "
            f"| {tflops_cell(row, 'grpo', peak)} / {tflops_cell(row, 'trl', peak)} | {pair(row, mem_key, '.1f')} |")
    errors = [f"- {row['case']}, {side}: {row[side]['error']}" for row in report["cases"] for side in SIDE_NAMES
              if row.get(side) and "error" in row[side]]
    return "\n".join(lines + (["", "Crashes:", *errors] if errors else []))


def merge(paths: list[str], case_order: list[str]) -> dict:
    """One report from runs of the same settings made in several calls (a later file's side of a case
    replaces an earlier one's, other sides are kept); the matmul peak is the mean of the files' peaks."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    first = reports[0]
    for path, report in zip(paths[1:], reports[1:]):
        for key in ("device_name", "versions", "shape_name", "shape", "settings", "grpo_commit"):
            if report[key] != first[key]:
                raise SystemExit(f"--merge: {path} has another {key} ({report[key]!r}) than {paths[0]} "
                                 f"({first[key]!r}); only runs of the same settings make one table")
    rows: dict[str, dict] = {}
    for report in reports:
        for row in report["cases"]:
            rows[row["case"]] = {**rows.get(row["case"], {}), **row}
    merged = dict(first, cases=sorted(rows.values(), key=lambda r: case_order.index(r["case"])),
                  matmul_peak_tflops=statistics.fmean(r["matmul_peak_tflops"] for r in reports))
    return merged
