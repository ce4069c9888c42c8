"""Build ``assets/tiny-rg``: the shipped tiny-math model taught to read reasoning-gym's chain_sum wording (CPU).

The shipped ``assets/tiny-math`` scores 0% on ``reasoning_gym:chain_sum`` (greedy and sampled, format 0%): it
was trained on grpo's own word problems, and reasoning-gym's "State the final answer to the following
arithmetic problem: 4 - 1 =" is text it has never read, so GRPO has no reward to follow. This script starts
from its weights and tokenizer and fine-tunes them (SFT, loss on the completion only) on chain_sum problems of
two and three one-digit terms (``configs/rg-demo-cpu.yaml``'s task, other seeds) in the task's prompt
(``grpo.tasks.reasoning_gym_task`` system prompt, the chat template), in tiny-math's completion format::

    <think>\n2 - 0 = 2\n2 - 6 = -4\n</think>\n<answer>\n-4\n</answer>

**Planted headroom for RL**, as ``build_tiny_math_model.py`` does for the main demo: in ``--planted-fraction``
(60%) of the three-term problems the chain stops after its first step and answers that partial sum. Greedy
decoding then follows the majority and stops early on three-term sums, while sampling at temperature 1.0 goes on
often enough for GRPO to find the reward; the demo's gain is this planted mistake being removed, not new
arithmetic. Training problems use seeds from 1,000,000 on (the held-out set's is 123).

    python scripts/build_tiny_rg_model.py                      # 300 steps: 8.5 minutes on 2 busy CPU cores
    python scripts/build_tiny_rg_model.py --steps 80 --out /tmp/tiny-rg
Needs reasoning-gym (``pip install 'grpo[envs]'``). Deterministic from ``--seed`` on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from build_tiny_math_model import mean_token_loss  # noqa: E402  (this folder; sets the OpenMP policy first)

import torch  # noqa: E402

from grpo.data import Example, load_dataset_source, render_example  # noqa: E402
from grpo.tasks.reasoning_gym_task import rg_system_prompt  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_TASK = "chain_sum,min_terms=2,max_terms=3,min_digits=1,max_digits=1"  # a + b, and a + b - c: one or two steps
PLANTED_FRACTION = 0.6  # share of the two-step problems whose chain stops after its first step


def chain_steps(expression: str) -> list[tuple[str, int]]:
    """``"2 - 0 - 6"`` -> ``[("2 - 0", 2), ("2 - 6", -4)]``: each step's left side and value, left to right."""
    tokens = expression.split()
    value, steps = int(tokens[0]), []
    for op, term in zip(tokens[1::2], tokens[2::2], strict=True):
        left = f"{value} {op} {term}"
        value = value + int(term) if op == "+" else value - int(term)
        steps.append((left, value))
    return steps


def completion_text(example: Example, planted: bool) -> str:
    """The chain in tiny-math's format, then its last value as the answer; ``planted``: stop after step one."""
    expression = example.question.rsplit(":", 1)[1].strip().rstrip("=").strip()
    steps = chain_steps(expression)
    if steps[-1][1] != int(example.answer_raw):
        raise ValueError(f"chain of {expression!r} gives {steps[-1][1]}, the dataset says {example.answer_raw}")
    if planted:
        steps = steps[:1]
    lines = "\n".join(f"{left} = {value}" for left, value in steps)
    return f"<think>\n{lines}\n</think>\n<answer>\n{steps[-1][1]}\n</answer>"


def rows_for(tokenizer, examples: list[Example], system_prompt: str, rng: random.Random,
             planted_fraction: float) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per example: the prompt as the trainer renders it (no loss), completion + EOS (loss)."""
    prompts = [render_example(tokenizer, e, system_prompt) for e in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    texts = [completion_text(e, planted=e.question.count(" + ") + e.question.count(" - ") > 1
                             and rng.random() < planted_fraction) for e in examples]
    completion_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    rows = []
    for p, c in zip(prompt_ids, completion_ids, strict=True):
        target = c + [tokenizer.eos_token_id]
        rows.append((p + target, [-100] * len(p) + target))
    return rows


def sft(model, tokenizer, steps: int, batch_size: int, learning_rate: float, seed: int,
        planted_fraction: float) -> list[dict]:
    """``steps`` AdamW steps, the learning rate decaying linearly to 0; returns the logged losses."""
    system_prompt = rg_system_prompt("think")
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    rng = random.Random(seed)
    history = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * (1.0 - step / steps)
        source = f"reasoning_gym:{TRAIN_TASK},size={batch_size},seed={1_000_000 + seed * 100_000 + step}"
        loss = mean_token_loss(model, rows_for(tokenizer, load_dataset_source(source), system_prompt, rng, planted_fraction),
                               tokenizer.pad_token_id, chunks=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            history.append({"step": step + 1, "loss": round(loss.item(), 4)})
            print(json.dumps(history[-1]), flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=REPO_ROOT / "assets" / "tiny-math", help="model to start from")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets" / "tiny-rg", help="output folder")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--planted-fraction", type=float, default=PLANTED_FRACTION,
                        help="share of two-step problems whose chain stops after one step")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)  # the demo machine: 2 CPU cores
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    history = sft(model, tokenizer, args.steps, args.batch_size, args.learning_rate, args.seed,
                  args.planted_fraction)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {"base": str(args.base.relative_to(REPO_ROOT) if args.base.is_relative_to(REPO_ROOT) else args.base),
              "train_task": f"reasoning_gym:{TRAIN_TASK}", "steps": args.steps, "batch_size": args.batch_size,
              "learning_rate": args.learning_rate, "seed": args.seed,
              "planted_fraction": args.planted_fraction, "losses": history,
              "wall_seconds": round(time.perf_counter() - start, 1)}
    (args.out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
