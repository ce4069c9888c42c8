"""Build ``assets/tiny-tools``: tiny-math taught by SFT to sometimes call a ``calculator`` tool (issue 27).

The model of ``configs/tools-demo-cpu.yaml``: a 2.5M Qwen2 that answers one-step word problems itself or
calls ``grpo.multiturn.calculator:calculator`` in the hermes format (``<tool_call>{"name": "calculator",
"arguments": {"expression": "4821 * 37"}}</tool_call>``), then copies the result into its answer. Alone it
is good at small numbers and bad at large ones; with the tool it is right on both. SFT teaches the call on a
minority of problems only, so GRPO has headroom: calling more on large numbers raises accuracy.

    python scripts/build_tiny_tool_model.py                               # the shipped build (CPU, see the report)
    python scripts/build_tiny_tool_model.py --quick --out /tmp/tiny-tools # smoke build for the test
    python scripts/build_tiny_tool_model.py --evaluate runs/tools-demo/final  # the report's numbers for any model

What is built, and why:
1. **Start from tiny-math** (``assets/tiny-math``: weights, tokenizer, answer format, small-number
   arithmetic): training that from scratch takes ~2.5 h on a 2-core CPU; this fine-tune takes minutes.
2. **Tool tokens** (``tiny_tool_sft_data.TOOL_TOKENS``): ``<tool_call>`` and the other markers, and the
   calculator's JSON strings, as added single tokens (not special, so the decoded text the driver parses
   keeps them). Their embedding rows (tied with the output head) start as the mean of the rows of the
   tokens the old tokenizer split them into.
3. **Compact chat template** (``tiny_tool_sft_data.CHAT_TEMPLATE``): Qwen2.5's tool format (prefix-preserving,
   checked by ``grpo.multiturn.conversation``) with a one-line JSON summary of each tool instead of the full
   schema, which alone was ~290 tokens.
4. **SFT rows**: problems from ``arithmetic-tools`` (half large, half small; training seeds 10**6 and up,
   never the held-out 123), prompts rendered with the calculator's schema as the multi-turn driver renders
   them. A share of the problems (``tool_fraction_large`` / ``_small``) is a calculator call, its result
   (context, no loss: as the driver inserts it) and an answer copying it; the rest are answered directly
   with the true result, which the model learns for small numbers and not for large ones (the headroom).
   After a call the answer is the result alone (``<think>\nN\n</think>``): with the equation written again
   the model recomputed it instead of copying.
   Loss only on the assistant's turns.
5. **Report**: held-out ``arithmetic-tools:seed=123`` large and small problems with a small multi-turn loop
   of its own (HF ``generate``, the real calculator, ``tool_suffix_ids``): greedy and T=1.0 accuracy,
   tool-call rate, accuracy with and without a call, the share of calls that return the gold answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Before torch loads OpenMP (see build_tiny_math_model.py: busy-waiting threads on a shared 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from build_tiny_math_model import learning_rate_at, mean_token_loss, set_overrides
from tiny_tool_sft_data import (
    HELD_OUT_SEED,
    TAG_STYLE,
    TOOL_TOKENS,
    problem_rows,
    shared_prompt_prefix,
    with_tool_tokens,
)

from grpo.data import build_prompt_messages, load_dataset_source, resolve_system_prompt
from grpo.multiturn.calculator import calculator
from grpo.multiturn.conversation import check_tool_template, tool_suffix_ids
from grpo.multiturn.tool_calls import parse_hermes
from grpo.multiturn.tools import PendingCall, Toolbox
from grpo.rewards.answers import (
    answers_equal,
    completion_text,
    extract_answer,
    gold_answer,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BuildSettings:
    """Every knob of the build; all of it is written into build_report.json."""

    seed: int = 0
    base: str = "assets/tiny-math"  # weights and tokenizer the build starts from (relative to the repo)
    steps: int = 300
    batch_size: int = 64  # problems per step (half large, half small)
    tool_fraction_large: float = 0.4  # share of large problems taught as a calculator call
    tool_fraction_small: float = 0.1
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    loss_chunks: int = 2
    # held-out report
    eval_n: int = 200  # problems per size
    eval_samples: int = 4  # T=1.0 samples per problem
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 48  # per turn
    eval_batch_size: int = 200
    max_tool_calling_iterations: int = 1

    @property
    def system_prompt(self) -> str:
        return resolve_system_prompt(None, TAG_STYLE)

    def eval_data(self, size: str) -> str:
        return f"arithmetic-tools:seed={HELD_OUT_SEED},n={self.eval_n},size={size}"


QUICK = {"steps": 20, "batch_size": 16, "eval_n": 24, "eval_samples": 2}


# --- model -------------------------------------------------------------------------------------------


def load_base(settings: BuildSettings):
    """tiny-math with the tool tokens: embedding rows of a new token = mean of its old pieces' rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = REPO_ROOT / settings.base
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pieces = {t: tokenizer(t, add_special_tokens=False)["input_ids"] for t in TOOL_TOKENS}
    tokenizer, new_ids = with_tool_tokens(tokenizer)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        for token_id in new_ids:
            embeddings[token_id] = embeddings[pieces[tokenizer.convert_ids_to_tokens(token_id)]].mean(0)
    assert model.get_output_embeddings().weight.data_ptr() == embeddings.data_ptr(), "embeddings must stay tied"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# --- SFT -----------------------------------------------------------------------------------------------


def sft(model, tokenizer, settings: BuildSettings, log_every: int = 25) -> dict:
    rng = random.Random(settings.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    prefix = shared_prompt_prefix(tokenizer, settings.system_prompt)
    model.train()
    start = time.perf_counter()
    history, totals = [], {}
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(settings, step, step / settings.steps)
        rows, counts = problem_rows(tokenizer, step, rng, settings)
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        loss = mean_token_loss(model, rows, tokenizer.pad_token_id, settings.loss_chunks, prefix=prefix)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == settings.steps:
            row = {"step": step + 1, "loss": round(loss.item(), 4), "lr": optimizer.param_groups[0]["lr"],
                   "seconds": round(time.perf_counter() - start, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
    model.eval()
    seconds = time.perf_counter() - start
    return {"steps": settings.steps, "seconds": round(seconds, 1),
            "seconds_per_step": round(seconds / max(settings.steps, 1), 3),
            "taught_tool_share_large": round(totals["large_tool"] / max(totals["large"], 1), 3),
            "taught_tool_share_small": round(totals["small_tool"] / max(totals["small"], 1), 3),
            "prompt_prefix_tokens": len(prefix), "history": history}


# --- multi-turn evaluation -------------------------------------------------------------------------------


def generate_turn(model, tokenizer, contexts: list[list[int]], settings: BuildSettings, temperature: float,
                  generator_seed: int) -> list[list[int]]:
    """One sampled (or greedy, temperature 0) turn per context: its ids up to and including EOS."""
    out = []
    for start in range(0, len(contexts), settings.eval_batch_size):
        chunk = contexts[start:start + settings.eval_batch_size]
        width = max(len(c) for c in chunk)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                    else {"do_sample": False})
        torch.manual_seed(generator_seed + start)
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.eval_max_new_tokens,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                       **sampling)
        for row in generated[:, width:].tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            out.append(row[:end])
    return out


def multi_turn(model, tokenizer, examples, settings: BuildSettings, temperature: float, samples: int) -> list[dict]:
    """``samples`` multi-turn completions per example, as the driver makes them: a turn, its calls run with the
    real calculator (errors answered as the driver answers them), their results appended with
    ``tool_suffix_ids``, the next turn; up to ``max_tool_calling_iterations`` tool rounds."""
    toolbox = Toolbox([calculator], timeout_s=5.0)
    eos = [tokenizer.eos_token_id]
    rows = []
    for example in examples:
        messages = build_prompt_messages(example, settings.system_prompt)
        text = tokenizer.apply_chat_template(messages, tools=toolbox.schemas, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for _ in range(samples):
            rows.append({"example": example, "context": list(prompt), "messages": [], "calls": 0, "call_right": 0,
                         "failures": 0, "done": False})
    for iteration in range(settings.max_tool_calling_iterations + 1):
        active = [r for r in rows if not r["done"]]
        if not active:
            break
        turns = generate_turn(model, tokenizer, [r["context"] for r in active], settings, temperature,
                              settings.seed + 1000 * iteration)
        for row, ids in zip(active, turns):
            row["context"] += ids
            text = tokenizer.decode(ids, skip_special_tokens=True)
            content, calls = parse_hermes(text)
            message = {"role": "assistant", "content": content if calls else text}
            row["done"] = not calls or not ids or ids[-1] != tokenizer.eos_token_id
            if calls:
                message["tool_calls"] = [c.message() for c in calls]
            row["messages"].append(message)
            if row["done"] or iteration == settings.max_tool_calling_iterations:
                row["done"] = True
                continue
            tool_messages = []
            for call in calls:
                pending = (toolbox.start(call.name, call.arguments) if call.error is None  # malformed: its parse error
                           else PendingCall(toolbox, call.name or "unknown", None, error=call.error))
                outcome = pending.outcome()
                row["calls"] += 1
                row["failures"] += outcome.failed
                row["call_right"] += (not outcome.failed and answers_equal(outcome.text, gold_answer(row["example"].answer)))
                tool_messages.append({"role": "tool", "name": outcome.name, "content": outcome.text})
            row["messages"] += tool_messages
            row["context"] += tool_suffix_ids(tokenizer, tool_messages, eos)
    for row in rows:
        answer = extract_answer(completion_text(row["messages"]), TAG_STYLE)
        row["correct"] = answers_equal(answer, gold_answer(row["example"].answer))
    return rows


def summarise(rows: list[dict]) -> dict:
    n = len(rows)
    called = [r for r in rows if r["calls"]]
    alone = [r for r in rows if not r["calls"]]
    calls = sum(r["calls"] for r in rows)

    def share(part, whole):
        return round(part / whole, 4) if whole else None

    return {
        "n": n,
        "accuracy": share(sum(r["correct"] for r in rows), n),
        "tool_call_rate": share(len(called), n),  # completions with at least one call
        "calls_per_completion": round(calls / n, 4),
        "accuracy_with_call": share(sum(r["correct"] for r in called), len(called)),
        "accuracy_without_call": share(sum(r["correct"] for r in alone), len(alone)),
        "correct_call_share": share(sum(r["call_right"] for r in rows), calls),  # calls returning the gold answer
        "failure_rate": share(sum(r["failures"] for r in rows), calls),
    }


def held_out_report(model, tokenizer, settings: BuildSettings) -> dict:
    t0 = time.perf_counter()
    report = {}
    for size in ("large", "small"):
        examples = load_dataset_source(settings.eval_data(size))
        greedy = multi_turn(model, tokenizer, examples, settings, temperature=0.0, samples=1)
        sampled = multi_turn(model, tokenizer, examples, settings, settings.eval_temperature, settings.eval_samples)
        report[size] = {"data": settings.eval_data(size), "greedy": summarise(greedy),
                        f"T={settings.eval_temperature:g}": summarise(sampled),
                        "greedy_example": greedy[0]["messages"]}
    report["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return report


# --- the build -------------------------------------------------------------------------------------------


def build(settings: BuildSettings, out: Path) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(settings.seed)
    model, tokenizer = load_base(settings)
    check_tool_template(tokenizer, Toolbox([calculator], 5.0).schemas)
    tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "1"}], [tokenizer.eos_token_id])
    training = sft(model, tokenizer, settings)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    held_out = held_out_report(model, tokenizer, settings)
    report = {
        "held_out": held_out,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "training": training,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
        "settings": {**dataclasses.asdict(settings), "system_prompt": settings.system_prompt},
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def summary(report: dict) -> str:
    lines = []
    for size in ("large", "small"):
        for mode, m in report["held_out"][size].items():
            if not isinstance(m, dict):
                continue
            lines.append(f"{size:5s} {mode:6s} acc {m['accuracy']:.1%}  tool-call rate {m['tool_call_rate']:.1%}  "
                         f"acc with call {m['accuracy_with_call']}  without {m['accuracy_without_call']}  "
                         f"calls right {m['correct_call_share']}  failures {m['failure_rate']}")
    if "training" not in report:
        return "\n".join(lines)
    t = report["training"]
    lines.append(f"params {report['params']:,}; {t['steps']} SFT steps in {t['seconds']:.0f} s "
                 f"({t['seconds_per_step']:.2f} s/step); build {report['wall_seconds']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BuildSettings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets" / "tiny-tools", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SFT data and the report's sampling")
    parser.add_argument("--steps", type=int, help=f"SFT steps (default {BuildSettings.steps})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any BuildSettings field, e.g. --set tool_fraction_large=0.4")
    parser.add_argument("--quick", action="store_true", help=f"short run for the test: {QUICK}")
    parser.add_argument("--evaluate", type=Path, metavar="MODEL_DIR",
                        help="no build: the held-out report of a saved model (e.g. a GRPO run's final/), printed "
                             "and written to MODEL_DIR/tool_eval.json (per size, greedy and T=1, with and without calls)")
    args = parser.parse_args(argv)
    overrides: dict = {"seed": args.seed}
    overrides.update(set_overrides(parser, BuildSettings, args.set))
    if args.quick:
        overrides.update(QUICK)
    if args.steps is not None:
        overrides["steps"] = args.steps
    settings = BuildSettings(**overrides)
    if settings.steps < 1:
        parser.error("--steps must be >= 1")
    return settings, args.out, args.evaluate


def evaluate_saved(settings: BuildSettings, folder: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    held_out = held_out_report(model, tokenizer, settings)
    (folder / "tool_eval.json").write_text(json.dumps(held_out, indent=2) + "\n", encoding="utf-8")
    return held_out


def main(argv: list[str] | None = None) -> int:
    settings, out, evaluate_folder = parse_args(argv)
    torch.set_num_threads(2)  # the demo machine: 2 CPU cores
    if evaluate_folder is not None:
        held_out = evaluate_saved(settings, evaluate_folder)
        print(summary({"held_out": held_out}))
        return 0
    report = build(settings, out)
    print(summary(report))
    print(f"wrote {out} (report: {out / 'build_report.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
