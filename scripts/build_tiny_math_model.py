"""Build the embedded default model, ``assets/tiny-math``: a 2.5M-parameter Qwen2 taught synthetic math by SFT.

The shipped build (``assets/tiny-math/build_report.json`` has every setting and number) ran on one
H200 GPU: 1800 SFT steps in 259 s (4.5 min), then the held-out report. On the held-out 500
(``synthetic:seed=123,n=500,difficulty=demo``): greedy accuracy 40.6%, format rate 100%, pass@8 at
T=1.0 94.0% (one-step problems: greedy 91.2%; two- and three-step: greedy 4.2% / 9.5% because greedy
stops after the first step, pass@8 92.5% / 88.1%).

    python scripts/build_tiny_math_model.py --device cuda                # the shipped build (4.5 min on an H200)
    python scripts/build_tiny_math_model.py --quick --out /tmp/tiny-math # 2-core CPU smoke build (~3 min), for the test

The same recipe runs on a CPU (``--device cpu``, the default when no GPU is visible), but at about
5 s per step on 2 cores the full 1800 steps take ~2.5 hours; with the smaller batches of ``--quick``
the CPU reaches the format (100%) but not yet the arithmetic: a CPU build long enough to reach the
accuracy band is not practical, which is why the shipped weights are committed. The test
(tests/integration/test_tiny_math.py) runs ``--quick`` on CPU in CI and the full build under ``-m gpu``.

Everything is deterministic from ``--seed`` on a CPU when the length is given in steps (the default);
on a GPU, up to the kernels' own nondeterminism (atomic adds in backward). ``--minutes`` instead trains
until a wall-clock budget is spent (the step count then depends on the machine).

What is built, and why (measured on a 2-core CPU: /work/shared/notes/tiny-math-findings.md):
1. **Tokenizer** — byte-level BPE (``grpo.models.tiny.build_tokenizer``) trained on the generator's own
   text: rendered prompts, completions, bare arithmetic. Digits are one token each, the tag tokens
   and Qwen's special tokens are single tokens, the chat template is Qwen's, EOS is ``<|im_end|>``.
2. **Model** — Qwen2, hidden 192, 4 layers, 4 heads (4 KV heads), MLP 768, tied embeddings, fp32.
3. **SFT data** (``scripts/tiny_math_sft_data.py``) — problems from ``grpo.data.generate_problems(difficulty=MIX)`` with training seeds
   (never the held-out seed 123). The prompt is rendered exactly as the trainer renders it (the
   default "think" system prompt + the question, chat template, generation prompt); the target is
   ``<think>\\n{equations}\\n</think>\\n<answer>\\n{N}\\n</answer>`` then ``<|im_end|>``, one bare equation
   ("12 + 7 = 19") per step. The loss is on completion tokens only.
4. **Bare arithmetic in every batch** — short chains of equations with no prompt (loss on what is
   determined: each result and the copied left operand). Without them two-digit addition stays at
   ~10% in the time budget; with them one-step problems reach ~70%.
5. **Planted headroom for RL** — in ``PLANTED_FRACTION`` (60%) of the multi-step training problems
   the chain stops after the first step and answers that intermediate number. Greedy decoding then
   follows the majority and stops early on multi-step problems (low greedy accuracy), while sampling
   at temperature 1.0 continues the chain about 40% of the time, so GRPO has a reward signal to
   remove the mistake. The demo's large gain is this planted error being removed, not new arithmetic.
6. **Report** — held-out ``synthetic:seed=123,n=500,difficulty=MIX``: greedy accuracy, format rate,
   pass@8 at T=1.0, the same per number of steps (with how often greedy stops after step one),
   parameters, wall time, settings; printed and written to ``OUT/build_report.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Before torch loads OpenMP: with busy-waiting threads, 2 threads on a 2-core machine that is also
# running anything else slowed an SFT step ~10x (18 s instead of 1.8 s); yielding threads do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import yaml  # noqa: E402
from tiny_math_sft_data import (  # noqa: E402  (this folder: sys.path[0] when run as a script)
    EQUATION,
    HELD_OUT_SEED,
    PLANTED_FRACTION,
    TAG_STYLE,
    bare_rows,
    problem_rows,
    shared_prompt_prefix,
    tokenizer_corpus,
    training_problem_seed,
    with_text_tags,
)

from grpo.compat import cache_argument, returned_cache  # noqa: E402
from grpo.data import Example, generate_problems, load_dataset_source, resolve_system_prompt  # noqa: E402
from grpo.data.synthetic import MIXES  # noqa: E402
from grpo.models.tiny import build_qwen2, build_tokenizer  # noqa: E402
from grpo.evaluation.evaluate import evaluate  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BuildSettings:
    """Every knob of the build; all of it is written into build_report.json."""

    seed: int = 0
    steps: int | None = 1800  # optimisation steps; None = train until `minutes` is spent
    minutes: float | None = None  # wall-clock budget of the SFT loop (used when steps is None)
    mix: str = "demo"  # generator difficulty (grpo.data.synthetic.MIXES) for training and held-out
    planted_fraction: float = PLANTED_FRACTION
    # model
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    vocab_size: int = 512  # BPE vocabulary before the added special tokens
    tokenizer_problems: int = 2000  # generated problems whose text trains the tokenizer
    # SFT
    batch_size: int = 128  # word problems per step
    bare_per_step: int = 256  # bare arithmetic chains per step
    bare_style: str = "chain"  # "chain" or "expression" (see bare_chain_text)
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # held-out report
    eval_data: str = f"synthetic:seed={HELD_OUT_SEED},n=500,difficulty=demo"
    eval_samples: int = 8
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 64
    eval_batch_size: int = 256
    device: str = "cpu"  # "cuda" trains the same recipe on a GPU (the shipped build; see the header)
    loss_chunks: int = 2  # forward passes per batch (fewer on a GPU, where padding costs nothing)

    @property
    def system_prompt(self) -> str:
        return resolve_system_prompt(None, TAG_STYLE)


QUICK = {"steps": 150, "batch_size": 32, "bare_per_step": 128, "eval_data": f"synthetic:seed={HELD_OUT_SEED},n=100,difficulty=demo"}


def right_pad(rows: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device):
    """(ids, labels) lists -> (input_ids [B, L], attention_mask [B, L], labels [B, L] padded with -100)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        target[i, :len(label)] = torch.tensor(label)
    return ids.to(device), mask.to(device), target.to(device)


def mean_token_loss(model, rows: list[tuple[list[int], list[int]]], pad_id: int, chunks: int,
                    prefix: list[int] | None = None) -> torch.Tensor:
    """Cross-entropy averaged over all labelled tokens of ``rows``, in ``chunks`` forward passes over
    rows sorted by length (less padding than one pass; the same loss).

    prefix: ids every row starts with and that carry no label (the system turn of every prompt). It
    is run once per chunk and its keys/values are shared by the chunk's rows (gradients flow through
    them), which spares about a third of a word-problem batch's compute; the logits are those of the
    full sequences (checked to 1e-6).
    """
    rows = sorted(rows, key=lambda row: len(row[0]))
    size = math.ceil(len(rows) / chunks)
    skip = len(prefix) if prefix else 0
    if prefix:
        assert all(ids[:skip] == prefix and all(t == -100 for t in labels[:skip + 1]) for ids, labels in rows)
    total_tokens = sum(sum(t != -100 for t in labels[1:]) for _, labels in rows)  # labels shift by one
    device = next(model.parameters()).device
    loss = torch.zeros((), device=device)
    for start in range(0, len(rows), size):
        ids, mask, labels = right_pad(rows[start:start + size], pad_id, device)
        cache = None
        if prefix:
            cache = returned_cache(model(input_ids=torch.tensor([prefix], device=device), use_cache=True))
            cache.batch_repeat_interleave(ids.shape[0])
        logits = model(input_ids=ids[:, skip:], attention_mask=mask, **cache_argument(cache),
                       use_cache=cache is not None).logits[:, :-1]  # [b, L-skip-1, V]
        loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        labels[:, skip + 1:].reshape(-1), ignore_index=-100,
                                                        reduction="sum")
    return loss / max(total_tokens, 1)


# --- training --------------------------------------------------------------------------------------


def learning_rate_at(settings: BuildSettings, step: int, progress: float) -> float:
    """Linear warm-up over `warmup_steps`, then linear decay to zero as `progress` (0..1) runs out."""
    warmup = min(1.0, (step + 1) / settings.warmup_steps)
    return settings.learning_rate * min(warmup, max(0.0, 1.0 - progress))


def sft(model, tokenizer, settings: BuildSettings, log_every: int = 50) -> dict:
    """Supervised fine-tuning; returns what happened (steps, seconds, final losses)."""
    rng = random.Random(settings.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.99),
                                  weight_decay=settings.weight_decay)
    budget_s = None if settings.steps is not None else settings.minutes * 60.0
    prefix = shared_prompt_prefix(tokenizer, settings.system_prompt)
    model.train()
    start, step, planted_total, multi_total = time.perf_counter(), 0, 0, 0
    history = []
    while True:
        elapsed = time.perf_counter() - start
        progress = step / settings.steps if budget_s is None else elapsed / budget_s
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(settings, step, progress)
        examples = generate_problems(settings.batch_size, seed=training_problem_seed(settings.seed, step),
                                     difficulty=settings.mix)
        multi_total += sum(1 for e in examples if "\n" in e.solution)
        rows, planted = problem_rows(tokenizer, examples, rng, settings)
        planted_total += planted
        problem_loss = mean_token_loss(model, rows, tokenizer.pad_token_id, settings.loss_chunks,
                                       prefix=prefix)
        bare_loss = mean_token_loss(model, bare_rows(tokenizer, rng, settings), tokenizer.pad_token_id,
                                    2 * settings.loss_chunks)
        optimizer.zero_grad(set_to_none=True)
        (problem_loss + bare_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        step += 1
        if step % log_every == 0 or step == 1:
            row = {"step": step, "problem_loss": round(problem_loss.item(), 4), "bare_loss": round(bare_loss.item(), 4),
                   "lr": optimizer.param_groups[0]["lr"], "seconds": round(time.perf_counter() - start, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
    model.eval()
    seconds = time.perf_counter() - start
    return {"steps": step, "seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(step, 1), 3),
            "planted_share_of_multi_step": round(planted_total / max(multi_total, 1), 3), "history": history}


# --- held-out report --------------------------------------------------------------------------------


def breakdown(records: list[dict], examples: list[Example], samples: int) -> dict:
    """Metrics per number of steps: greedy accuracy and format, pass@k, mean sample accuracy, and how
    often the greedy chain stops after one equation (the planted mistake)."""
    groups: dict[int, list[tuple[dict, Example]]] = defaultdict(list)
    for record, example in zip(records, examples):
        groups[example.solution.count("\n") + 1].append((record, example))
    result = {}
    for steps, rows in sorted(groups.items()):
        n = len(rows)
        greedy_lines = [len(EQUATION.findall(r["completion"])) for r, _ in rows]
        result[f"{steps}-step"] = {
            "n": n,
            "accuracy": round(sum(r["correct"] for r, _ in rows) / n, 4),
            "format_rate": round(sum(r["formatted"] for r, _ in rows) / n, 4),
            f"pass@{samples}": round(sum(r["sample_correct"] > 0 for r, _ in rows) / n, 4),
            "mean_sample_accuracy": round(sum(r["sample_correct"] for r, _ in rows) / (n * samples), 4),
            "greedy_stops_after_one_step": round(sum(k == 1 for k in greedy_lines) / n, 4),
        }
    return result


def held_out_report(model, tokenizer, settings: BuildSettings) -> dict:
    examples = load_dataset_source(settings.eval_data)
    t0 = time.perf_counter()
    result = evaluate(model, tokenizer, examples, tag_style=TAG_STYLE, system_prompt=settings.system_prompt,
                      batch_size=settings.eval_batch_size, max_new_tokens=settings.eval_max_new_tokens,
                      samples=settings.eval_samples, temperature=settings.eval_temperature, seed=settings.seed,
                      progress=False, return_records=True)
    records = result.pop("records")
    k = settings.eval_samples
    return {
        "data": settings.eval_data,
        "n": result["n"],
        "accuracy": round(result["accuracy"], 4),
        "format_rate": round(result["format_rate"], 4),
        f"pass@{k}": round(result[f"pass@{k}"], 4),
        "mean_sample_accuracy": round(result["mean_sample_accuracy"], 4),
        "sample_format_rate": round(result["sample_format_rate"], 4),
        "truncated_rate": round(result["truncated_rate"], 4),
        # greedy decoding is deterministic: the test re-runs these 100 to tie the report to the weights
        "first_100_accuracy": round(sum(r["correct"] for r in records[:100]) / min(100, len(records)), 4),
        "temperature": settings.eval_temperature,
        "by_steps": breakdown(records, examples, k),
        "eval_seconds": round(time.perf_counter() - t0, 1),
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
    model.to("cpu").save_pretrained(out)  # the asset is loaded on CPUs; the report evaluates it where it trained
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
                     "mix_levels": [dataclasses.asdict(level) for level in MIXES[settings.mix]]},
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def summary(report: dict) -> str:
    h = report["held_out"]
    k = next(key for key in h if key.startswith("pass@"))
    lines = [f"held-out {h['data']}: greedy accuracy {h['accuracy']:.1%}, format rate {h['format_rate']:.1%}, "
             f"{k} at T={h['temperature']:g} {h[k]:.1%}"]
    for name, row in h["by_steps"].items():
        lines.append(f"  {name:7s} n={row['n']:3d}  greedy {row['accuracy']:.1%}  {k} {row[k]:.1%}  "
                     f"stops after one step {row['greedy_stops_after_one_step']:.1%}")
    t = report["training"]
    lines.append(f"params {report['params']:,}; {t['steps']} SFT steps in {t['seconds']:.0f} s "
                 f"({t['seconds_per_step']:.2f} s/step); build {report['wall_seconds']:.0f} s")
    return "\n".join(lines)


def set_overrides(parser: argparse.ArgumentParser, settings_type: type, items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as fields of ``settings_type`` (the tiny build scripts' BuildSettings): text
    fields as given, the others parsed as YAML, lists as tuples (the settings are frozen); an unknown key is
    a usage error listing the known ones."""
    defaults = settings_type()
    names = sorted(f.name for f in dataclasses.fields(settings_type))
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in names:
            parser.error(f"--set {item!r}: unknown setting {key!r}; known: {names}")
        parsed = value if isinstance(getattr(defaults, key), str) else yaml.safe_load(value)
        overrides[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    return overrides


def parse_args(argv: list[str] | None) -> tuple[BuildSettings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets" / "tiny-math", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of tokenizer data, initial weights and SFT data")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help=f"SFT steps (default {BuildSettings.steps}; deterministic)")
    length.add_argument("--minutes", type=float, help="SFT wall-clock budget instead of a step count")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (the same recipe; default: cuda when a GPU is visible)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any BuildSettings field (experiments), e.g. --set planted_fraction=0.7")
    parser.add_argument("--quick", action="store_true",
                        help=f"short run for the test: {QUICK['steps']} steps, 100 held-out problems")
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
    return settings, args.out


def main(argv: list[str] | None = None) -> int:
    settings, out = parse_args(argv)
    torch.set_num_threads(2)  # the demo machine: 2 CPU cores
    report = build(settings, out)
    print(summary(report))
    print(f"wrote {out} (report: {out / 'build_report.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
