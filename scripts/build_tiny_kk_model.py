"""Build ``assets/tiny-kk``: a small Qwen2 taught Knights and Knaves (2-3 people) by SFT on a mechanical trace.

The K&K demo's model (``configs/kk-demo-cpu.yaml``), built the way ``build_tiny_math_model.py`` builds
tiny-math, on a CPU. Shipped as ``assets/tiny-kk`` (the default 1200-step build, seed 0); rebuild it or
try other settings with:

    python scripts/build_tiny_kk_model.py                              # assets/tiny-kk (1200 steps, see below)
    python scripts/build_tiny_kk_model.py --quick --out /tmp/tiny-kk   # smoke build for the test (~4 min, 1 thread)
    python scripts/build_tiny_kk_model.py --report runs/kk-demo/final  # the held-out report of any saved model

Measured, the shipped build: 1200 steps at 3.69 s/step on one thread of the 2-core CPU shared with other
jobs (74 min). On the 200 held-out puzzles: format rate 100%, greedy accuracy 20.0% with the shortcut taken by
100% of greedy completions (right on the 20.5% of puzzles whose answer is all knights), 60.7% of samples at
T=1.0 take it, mean sample accuracy 25.4%, pass@8 56.5%; greedy with the first check forced
(``checked_greedy_accuracy``) 48.5% (2 people 68.4%, 3 people 29.4%): 28.5 points GRPO can gain by removing
the shortcut. The demo recipe's GRPO (80 steps, 3 seeds, about 7 minutes each on the quiet 2-core CPU)
reaches 43.5-46.5% greedy with the shortcut gone from greedy decoding (0% of completions; 4.6-7.4% of
2-person and 28-33% of 3-person samples still take it).

Earlier builds did not leave that headroom: a 420-step build (27 min) learnt the format and the shortcut
but not the checking (a checked greedy trace right 9.0% of the time; teacher-forced, the T/F tokens were
right 61% of the time, near chance), so its GRPO run had nothing to gain. ``--set restate=true`` (the trace
restates each statement at its top, copied from the quiz, so every T/F is the drill's lookup; traces up to
~165 tokens, the recipe would need max_completion_length 176) was tried for 220 steps only, inconclusively.
The integration test checks that the shipped build's ``checked_greedy_accuracy`` is at least 15 points
above its greedy accuracy and that its weights reproduce the report.

Everything is deterministic from ``--seed`` on a CPU when the length is given in steps (the default).
``--minutes`` instead trains until a wall-clock budget is spent; ``--device cuda`` runs the same recipe on
a GPU; ``--set KEY=VALUE`` overrides any ``BuildSettings`` field.

What is built, and why:
1. **Puzzles** — ``grpo.data.knights_knaves.generate_puzzles`` with 2-3 people (``people``), all six
   statement forms, training seeds from 10**6 up (never the held-out seed 123). Larger puzzles would need
   16+ trace lines: too long for a small model to learn in the budget and for GRPO sampling on a CPU.
2. **Tokenizer** — byte-level BPE (``grpo.models.tiny.build_tokenizer``, a 1024-token vocabulary) trained on the rendered
   prompts, traces, answers and drills: every name, "knight", "knave", " is", " a" and the trace's
   K/N/T/F/ok/no are one token each, so a 3-person prompt is ~180 tokens (the first ~100, system turn and
   the quiz's fixed introduction, shared by every prompt and computed once per SFT chunk) and the longest
   trace + answer ~130. The answer tags are ordinary added tokens (``with_text_tags``), EOS is ``<|im_end|>``.
3. **Model** — Qwen2, hidden 192, 4 layers, 4 heads, MLP 768, tied embeddings, fp32 (2.5M parameters).
4. **SFT data** (``scripts/tiny_kk_sft_data.py``) — the prompt rendered exactly as the trainer renders a
   ``kk`` run's (``kk_system_prompt("think")`` + the quiz, chat template, generation prompt); the target is the
   enumeration trace and the canonical answer (that module's docstring shows one), then ``<|im_end|>``; loss
   on completion tokens only.
5. **Drills in every batch** — the people list and every assignment line, each with one random statement and
   its truth, labelled where determined. Without them the SFT loss stalled: after 240 steps of a first
   design (bare letters "K N = T F", no names in the lines, no drills) the answer's names were copied at 2%
   argmax accuracy and the T/F tokens were right 59% of the time, about chance.
6. **Planted headroom for RL** — ``PLANTED_FRACTION`` (60%) of the traces accept "everybody is a knight"
   unchecked (``Zoey K Oliver K ok``). Greedy decoding follows the majority (right only where that is the
   answer, ~20% of puzzles); sampling at T=1.0 checks the candidates ~40% of the time, so GRPO with
   ``kk_logic`` has a reward signal to remove the shortcut. The demo's gain is that shortcut removed, up to
   what the checked trace gets right (``checked_greedy_accuracy`` in the report), not new logic.
7. **Report** — on ``kk:seed=123,n=200,people=2-3`` (the demo's ``data.eval``), scored by the ``kk`` task:
   greedy accuracy and format rate, mean sample accuracy and pass@8 at T=1.0, how often greedy and sampled
   completions take the shortcut, sampled accuracy of the checked traces and greedy accuracy with the first
   check forced, all per number of people; printed and written to ``OUT/build_report.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Before torch loads OpenMP (see build_tiny_math_model.py: busy-waiting threads on a shared 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from build_tiny_math_model import learning_rate_at, mean_token_loss, set_overrides  # noqa: E402  (this folder: sys.path[0])
from tiny_kk_sft_data import (  # noqa: E402
    HELD_OUT_SEED,
    PLANTED_FRACTION,
    TAG_STYLE,
    UNCHECKED_FIRST_LINE,
    assignment_text,
    drill_rows,
    puzzle_example,
    puzzle_rows,
    system_prompt,
    tokenizer_corpus,
    training_puzzles,
)
from tiny_math_sft_data import with_text_tags  # noqa: E402

from grpo.data import render_example  # noqa: E402
from grpo.models.tiny import build_qwen2, build_tokenizer  # noqa: E402
from grpo.rollout import LeanEngine, SamplingParams  # noqa: E402
from grpo.tasks import resolve_task  # noqa: E402
from grpo.data.knights_knaves.generate import generate_puzzles  # noqa: E402
from grpo.data.knights_knaves.logic import solve  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BuildSettings:
    """Every knob of the build; all of it is written into build_report.json."""

    seed: int = 0
    steps: int | None = 1200  # optimisation steps; None = train until `minutes` is spent
    minutes: float | None = None  # wall-clock budget of the SFT loop (used when steps is None)
    people: tuple[int, int] = (2, 3)  # puzzle sizes, training and held-out
    planted_fraction: float = PLANTED_FRACTION
    restate: bool = False  # the trace restates each statement first (tiny_kk_sft_data.trace_lines)
    # model
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    vocab_size: int = 1024  # BPE vocabulary before the added special tokens
    tokenizer_puzzles: int = 2000  # generated puzzles whose text trains the tokenizer
    # SFT
    batch_size: int = 64  # puzzles per step
    drills_per_step: int = 32  # drills per step (tiny_kk_sft_data.drill_rows)
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # held-out report
    eval_n: int = 200
    eval_samples: int = 8
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 176
    eval_batch_size: int = 256
    device: str = "cpu"
    loss_chunks: int = 2  # forward passes per batch (fewer on a GPU, where padding costs nothing)

    @property
    def system_prompt(self) -> str:
        return system_prompt()

    @property
    def eval_data(self) -> str:
        """The held-out set as a data source string (configs/kk-demo-cpu.yaml data.eval)."""
        return f"kk:seed={HELD_OUT_SEED},n={self.eval_n},people={self.people[0]}-{self.people[1]}"


# Two people only and small batches: 60 steps of 3-person batches left the format unlearned (0%).
QUICK = {"steps": 150, "batch_size": 16, "drills_per_step": 8, "people": (2, 2), "warmup_steps": 15, "eval_n": 50,
         "tokenizer_puzzles": 500}


def shared_prompt_prefix(tokenizer, settings: BuildSettings) -> list[int]:
    """The longest run of token ids every rendered prompt starts with (system turn, the quiz's fixed
    introduction): computed once per chunk in ``mean_token_loss`` instead of once per row."""
    puzzles = generate_puzzles(64, seed=400_000 + settings.seed, people=tuple(settings.people))
    ids = [tokenizer(render_example(tokenizer, puzzle_example(p, "probe"), settings.system_prompt),
                     add_special_tokens=False)["input_ids"] for p in puzzles]
    length = 0
    while all(len(row) > length + 1 and row[length] == ids[0][length] for row in ids):
        length += 1
    return ids[0][:length]


# --- training --------------------------------------------------------------------------------------


def sft(model, tokenizer, settings: BuildSettings, log_every: int = 25) -> dict:
    """Supervised fine-tuning; returns what happened (steps, seconds, losses)."""
    rng = random.Random(settings.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.99),
                                  weight_decay=settings.weight_decay)
    budget_s = None if settings.steps is not None else settings.minutes * 60.0
    prefix = shared_prompt_prefix(tokenizer, settings)
    model.train()
    start, step, planted_total, seen = time.perf_counter(), 0, 0, 0
    history = []
    while True:
        elapsed = time.perf_counter() - start
        progress = step / settings.steps if budget_s is None else elapsed / budget_s
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(settings, step, progress)
        rows, planted = puzzle_rows(tokenizer, training_puzzles(settings, step), rng, settings)
        planted_total, seen = planted_total + planted, seen + len(rows)
        loss = mean_token_loss(model, rows, tokenizer.pad_token_id, settings.loss_chunks, prefix=prefix)
        drill_loss = mean_token_loss(model, drill_rows(tokenizer, rng, settings), tokenizer.pad_token_id,
                                     settings.loss_chunks)
        optimizer.zero_grad(set_to_none=True)
        (loss + drill_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        step += 1
        if step % log_every == 0 or step == 1 or step == settings.steps:
            row = {"step": step, "loss": round(loss.item(), 4), "drill_loss": round(drill_loss.item(), 4), "lr": optimizer.param_groups[0]["lr"],
                   "seconds": round(time.perf_counter() - start, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
    model.eval()
    seconds = time.perf_counter() - start
    return {"steps": step, "seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(step, 1), 3),
            "planted_share": round(planted_total / max(seen, 1), 3), "shared_prefix_tokens": len(prefix),
            "history": history}


# --- held-out report --------------------------------------------------------------------------------


def held_out_report(model, tokenizer, settings: BuildSettings) -> dict:
    """Greedy accuracy and format rate, mean sample accuracy and pass@k at ``eval_temperature``, how
    often a completion takes the planted shortcut, per number of people; scored by the ``kk`` task."""
    t0 = time.perf_counter()
    puzzles = generate_puzzles(settings.eval_n, seed=HELD_OUT_SEED, people=tuple(settings.people))
    examples = [puzzle_example(p, f"held-out:{i}") for i, p in enumerate(puzzles, start=1)]
    prompts = [render_example(tokenizer, e, settings.system_prompt) for e in examples]
    score = resolve_task("kk").score
    engine = LeanEngine(model, tokenizer, batch_size=settings.eval_batch_size)
    k = settings.eval_samples
    greedy = engine.generate(prompts, SamplingParams(n=1, max_tokens=settings.eval_max_new_tokens, greedy=True),
                             seed=settings.seed)
    sampled = engine.generate(prompts, SamplingParams(n=k, max_tokens=settings.eval_max_new_tokens,
                                                      temperature=settings.eval_temperature), seed=settings.seed)
    # Greedy again with the first line's check forced ("Zoey K Oliver K =" written for it): what greedy decoding
    # reaches once the shortcut is gone, the accuracy GRPO can climb to without learning new logic.
    opening = ["<think>\n" + (f"{p.names[0]}:" if settings.restate else
                               assignment_text(p.names, [True] * len(p.names)) + " =") for p in puzzles]
    checked = engine.generate([prompt + text for prompt, text in zip(prompts, opening)],
                              SamplingParams(n=1, max_tokens=settings.eval_max_new_tokens, greedy=True),
                              seed=settings.seed)
    records = []
    for i, (example, puzzle) in enumerate(zip(examples, puzzles)):
        first = score(greedy.completions[i], example.answer, TAG_STYLE)
        samples = [score(text, example.answer, TAG_STYLE) for text in sampled.completions[i * k:(i + 1) * k]]
        records.append({
            "people": len(puzzle.names),
            "all_knights": all(solve(puzzle)[0]),
            "correct": first["correct"], "formatted": first["formatted"],
            "checked_correct": score(opening[i] + checked.completions[i], example.answer, TAG_STYLE)["correct"],
            "shortcut": bool(UNCHECKED_FIRST_LINE.match(greedy.completions[i])),
            "truncated": bool(greedy.truncated[i]),
            "sample_correct": sum(s["correct"] for s in samples),
            "sample_formatted": sum(s["formatted"] for s in samples),
            "sample_shortcut": sum(bool(UNCHECKED_FIRST_LINE.match(t))
                                   for t in sampled.completions[i * k:(i + 1) * k]),
        })
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[f"people={record['people']}"].append(record)
    return {
        "data": settings.eval_data,
        **metrics(records, k),
        "first_100_accuracy": round(sum(r["correct"] for r in records[:100]) / min(100, len(records)), 4),
        "all_knights_share": round(sum(r["all_knights"] for r in records) / len(records), 4),
        "temperature": settings.eval_temperature,
        "by_people": {name: metrics(rows, k) for name, rows in sorted(groups.items())},
        "example_completion": greedy.completions[0],
        "eval_seconds": round(time.perf_counter() - t0, 1),
    }


def metrics(records: list[dict], k: int) -> dict:
    n = len(records)
    return {
        "n": n,
        "accuracy": round(sum(r["correct"] for r in records) / n, 4),
        "format_rate": round(sum(r["formatted"] for r in records) / n, 4),
        "truncated_rate": round(sum(r["truncated"] for r in records) / n, 4),
        f"pass@{k}": round(sum(r["sample_correct"] > 0 for r in records) / n, 4),
        "mean_sample_accuracy": round(sum(r["sample_correct"] for r in records) / (n * k), 4),
        "sample_format_rate": round(sum(r["sample_formatted"] for r in records) / (n * k), 4),
        "checked_greedy_accuracy": round(sum(r["checked_correct"] for r in records) / n, 4),
        "greedy_shortcut_rate": round(sum(r["shortcut"] for r in records) / n, 4),
        "sample_shortcut_rate": round(sum(r["sample_shortcut"] for r in records) / (n * k), 4),
        # what the trace reaches when it does not take the shortcut: the ceiling GRPO can climb to
        "sample_accuracy_when_checked": round(
            sum(r["sample_correct"] for r in records if not r["all_knights"])
            / max(1, sum(k - r["sample_shortcut"] for r in records if not r["all_knights"])), 4),
    }


# --- the build ----------------------------------------------------------------------------------------


def build(settings: BuildSettings, out: Path) -> dict:
    """Tokenizer -> model -> SFT -> save to ``out`` -> held-out report (also ``out/build_report.json``)."""
    t0 = time.perf_counter()
    tokenizer = with_text_tags(build_tokenizer(tokenizer_corpus(settings), vocab_size=settings.vocab_size))
    model = build_qwen2(tokenizer, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                        num_heads=settings.num_heads, num_kv_heads=settings.num_kv_heads,
                        intermediate_size=settings.intermediate_size, seed=settings.seed)
    torch.manual_seed(settings.seed)
    model.to(settings.device)
    training = sft(model, tokenizer, settings)
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)  # the model is loaded on CPUs; the report evaluates it where it trained
    model.to(settings.device)
    tokenizer.save_pretrained(out)
    held_out = held_out_report(model, tokenizer, settings)
    report = {
        "held_out": held_out,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "training": training,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
        "settings": {**dataclasses.asdict(settings), "system_prompt": settings.system_prompt,
                     "eval_data": settings.eval_data},
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def summary(report: dict) -> str:
    lines = held_out_summary(report["held_out"])
    t = report["training"]
    lines.append(f"params {report['params']:,}; {t['steps']} SFT steps in {t['seconds']:.0f} s "
                 f"({t['seconds_per_step']:.2f} s/step); build {report['wall_seconds']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BuildSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets" / "tiny-kk", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of tokenizer data, initial weights and SFT data")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help=f"SFT steps (default {BuildSettings.steps}; deterministic)")
    length.add_argument("--minutes", type=float, help="SFT wall-clock budget instead of a step count")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (the same recipe; default: cuda when a GPU is visible)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the demo machine has 2 cores)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any BuildSettings field (experiments), e.g. --set planted_fraction=0.7")
    parser.add_argument("--report", type=Path, metavar="MODEL",
                        help="build nothing: print the held-out report of a saved model (e.g. runs/kk-demo/final)")
    parser.add_argument("--quick", action="store_true",
                        help=f"short run for the test: {QUICK['steps']} steps, {QUICK['eval_n']} held-out puzzles")
    args = parser.parse_args(argv)
    overrides: dict = {"seed": args.seed, "device": args.device}
    if args.device != "cpu":
        overrides["loss_chunks"] = 1
    overrides.update(set_overrides(parser, BuildSettings, args.set))
    if args.quick:
        overrides.update(QUICK)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.minutes is not None:
        overrides.update(steps=None, minutes=args.minutes)
    settings = BuildSettings(**overrides)
    if settings.steps is not None and settings.steps < 1:
        parser.error("--steps must be >= 1")
    if settings.steps is None and not settings.minutes > 0:
        parser.error("--minutes must be > 0")
    return settings, args


def held_out_summary(held_out: dict) -> list[str]:
    k = next(key for key in held_out if key.startswith("pass@"))
    lines = [(f"held-out {held_out['data']}: greedy accuracy {held_out['accuracy']:.1%}, format rate "
              f"{held_out['format_rate']:.1%}, mean sample accuracy {held_out['mean_sample_accuracy']:.1%}, "
              f"{k} {held_out[k]:.1%} at T={held_out['temperature']:g}; all-knights answers "
              f"{held_out['all_knights_share']:.1%}")]
    for name, row in held_out["by_people"].items():
        lines.append(f"  {name} n={row['n']:3d}  greedy {row['accuracy']:.1%}  sample {row['mean_sample_accuracy']:.1%}"
                     f"  {k} {row[k]:.1%}  shortcut greedy {row['greedy_shortcut_rate']:.1%} / sampled "
                     f"{row['sample_shortcut_rate']:.1%}  checked: sampled {row['sample_accuracy_when_checked']:.1%}, "
                     f"greedy {row['checked_greedy_accuracy']:.1%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report is not None:  # e.g. a GRPO run's final model, on the held-out set the build reports
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.report).to(settings.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.report)
        print("\n".join(held_out_summary(held_out_report(model, tokenizer, settings))))
        return 0
    out = args.out
    report = build(settings, out)
    print(summary(report))
    print(f"wrote {out} (report: {out / 'build_report.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
