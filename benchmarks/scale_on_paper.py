"""Which setups grpo can train at 30B (MoE) and 70B (dense) on one node of 8 x 80 GB GPUs, from `grpo memory`.

    python benchmarks/scale_on_paper.py            # prints the table of docs/guides/scale.md, writes the JSON

Estimates, not measurements (no GPU node here): each row is `grpo memory`'s per-device peak for the trainer ranks
(estimate_memory, the numbers `grpo memory RECIPE OVERRIDES --gpus 8 --gpu-gb 80` prints) and, in decoupled mode,
the tensors of one sampler device. Every row shares one recipe: GSM8K-length prompts (512 tokens) and 1,024-token
completions, 56 prompts a step (whole groups on 7 or 8 ranks), micro-batches of 4, bf16 with gradient checkpointing and the fused LM head, k3 KL to the base policy
(beta 0.04) unless the row says beta 0. The model shapes are the public config.json values (grpo's built-in table).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPUS, GPU_GB = 8, 80.0
RECIPE = ("model.bf16=true", "model.gradient_checkpointing=true", "train.fused_lm_head=true",
          "data.max_prompt_length=512", "rollout.max_completion_length=1024", "train.micro_batch_size=4",
          "train.prompts_per_step=56", "loss.beta=0.04")
MOE, DENSE = "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-70B-Instruct"
# decoupled on one node: 7 trainer ranks and one vLLM sampler on the eighth GPU
DECOUPLED = ("train.mode=decoupled", f"decoupled.trainer_ranks={GPUS - 1}", "decoupled.num_samplers=1",
             "rollout.engine=vllm")


@dataclass(frozen=True)
class Setup:
    name: str
    model: str
    overrides: tuple[str, ...]


SETUPS = [
    Setup("full, FSDP2, colocated", MOE, ("train.fsdp=true",)),
    Setup("full, FSDP2, decoupled", MOE, ("train.fsdp=true", *DECOUPLED)),
    Setup("full, FSDP2, decoupled, beta 0", MOE, ("train.fsdp=true", *DECOUPLED, "loss.beta=0")),
    Setup("full, ZeRO-3, decoupled, beta 0", MOE, ("train.deepspeed=configs/ds_zero3.json", *DECOUPLED, "loss.beta=0")),
    Setup("LoRA r16, FSDP2, colocated", MOE, ("train.fsdp=true", "model.lora_r=16")),
    Setup("full, FSDP2, decoupled, beta 0", DENSE, ("train.fsdp=true", *DECOUPLED, "loss.beta=0")),
    Setup("full, FSDP2 + CPU offload, decoupled, beta 0", DENSE,
          ("train.fsdp=true", "fsdp.cpu_offload=true", *DECOUPLED, "loss.beta=0")),
    Setup("full, ZeRO-3, decoupled, beta 0", DENSE, ("train.deepspeed=configs/ds_zero3.json", *DECOUPLED, "loss.beta=0")),
    Setup("LoRA r16, FSDP2, colocated", DENSE, ("train.fsdp=true", "model.lora_r=16")),
    Setup("LoRA r16, FSDP2, decoupled, beta 0", DENSE, ("train.fsdp=true", "model.lora_r=16", *DECOUPLED, "loss.beta=0")),
]


def estimate(setup: Setup) -> dict:
    """The row of one setup: the trainer device's peak, its phase, the sampler device's tensors, the host memory an
    offload takes (fp32 shards, gradients and AdamW's m and v of the whole node: 16 B a parameter)."""
    from grpo.commands.memory import estimate_memory
    from grpo.config import load_config

    overrides = [*RECIPE, f"model.name_or_path={setup.model}", *setup.overrides]
    decoupled = "train.mode=decoupled" in setup.overrides
    est = estimate_memory(load_config(None, overrides), gpus=GPUS - 1 if decoupled else GPUS, gpu_gb=GPU_GB)
    offload = "fsdp.cpu_offload=true" in setup.overrides
    host_gb = est.assumptions["params"] * 16 / 2**30 if offload else None
    sampler_fits = None if est.sampler_gb is None else est.sampler_gb <= GPU_GB
    return {"model": setup.model, "setup": setup.name, "overrides": overrides, "trainer_gpus": est.gpus,
            "sampler_gpus": 1 if decoupled else 0, "trainer_gb": est.total_gb,
            "peak_phase": est.peak_phase, "trainer_fits": est.fits, "sampler_gb": est.sampler_gb,
            "sampler_fits": sampler_fits, "host_gb": host_gb,
            "trains": bool(est.fits) and sampler_fits is not False}


def table(rows: list[dict]) -> str:
    yes = {True: "yes", False: "**no**", None: "-"}
    lines = ["| model | setup | GPUs: trainer + sampler | trainer GPU (GiB) | peak phase | sampler GPU (GiB) "
             "| host RAM (GiB) | trains on 8 x 80 GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sampler = "-" if r["sampler_gb"] is None else f"{r['sampler_gb']:.0f}"
        host = "-" if r["host_gb"] is None else f"{r['host_gb']:,.0f}"
        gpus = f"{r['trainer_gpus']} + {r['sampler_gpus']}" if r["sampler_gpus"] else f"{r['trainer_gpus']}"
        lines.append(f"| {r['model'].split('/')[1]} | {r['setup']} | {gpus} | {r['trainer_gb']:.0f} | {r['peak_phase']} | "
                     f"{sampler} | {host} | {yes[r['trains']]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scale_on_paper.json"))
    args = parser.parse_args()
    rows = [estimate(setup) for setup in SETUPS]
    Path(args.out).write_text(json.dumps({"gpus": GPUS, "gpu_gb": GPU_GB, "recipe": list(RECIPE), "rows": rows},
                                         indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
