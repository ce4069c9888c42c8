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
1. **Tokenizer** — byte-level BPE (``grpo.tiny_model.build_tokenizer``) trained on the generator's own
   text: rendered prompts, completions, bare arithmetic. Digits are one token each, the tag tokens
   and Qwen's special tokens are single tokens, the chat template is Qwen's, EOS is ``<|im_end|>``.
2. **Model** — Qwen2, hidden 192, 4 layers, 4 heads (4 KV heads), MLP 768, tied embeddings, fp32.
3. **SFT data** — problems from ``grpo.data.generate_problems(difficulty=MIX)`` with training seeds
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
import re
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

from grpo.data import Example, generate_problems, load_dataset_source, render_example, resolve_system_prompt  # noqa: E402
from grpo.data.synthetic import MIXES, solution_chain  # noqa: E402
from grpo.evaluate import evaluate  # noqa: E402
from grpo.tiny_model import TAG_TOKENS, build_qwen2, build_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TAG_STYLE = "think"
PLANTED_FRACTION = 0.6  # share of multi-step SFT examples whose chain stops after the first step
HELD_OUT_SEED = 123  # the held-out set's seed (configs/demo-cpu.yaml data.eval); never trained on
BARE_CHAINS_PER_ROW = 4
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


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


# --- data ------------------------------------------------------------------------------------------


def equations(example: Example) -> list[str]:
    """The bare equations of an example's worked solution, one per step ("12 + 7 = 19")."""
    return ["{} {} {} = {}".format(*EQUATION.search(line).groups()) for line in example.solution.split("\n")]


def completion_text(chain: list[str], answer: str) -> str:
    """The target completion (before EOS): the chain inside <think>, the number inside <answer>."""
    return "<think>\n" + "\n".join(chain) + "\n</think>\n<answer>\n" + answer + "\n</answer>"


def sft_completion(example: Example, rng: random.Random, planted_fraction: float) -> tuple[str, bool]:
    """The completion an example is trained on, and whether it is a planted early stop.

    A multi-step example stops after its first step (answering that intermediate number) with
    probability ``planted_fraction``; one-step examples are always complete.
    """
    chain = equations(example)
    if len(chain) > 1 and rng.random() < planted_fraction:
        first = chain[0]
        return completion_text([first], first.split(" = ")[1]), True
    return completion_text(chain, example.answer), False


def training_problem_seed(seed: int, step: int) -> int:
    """Generator seed of one step's problems: 10**6 and up, so never the held-out seed 123."""
    return 1_000_000 + seed * 100_000 + step


def problem_rows(tokenizer, examples: list[Example], rng: random.Random, settings: BuildSettings):
    """Prompt + completion + EOS per example as (ids, labels) lists (labels -100 on the prompt), and
    the number of planted early stops. The prompt is tokenized on its own, as the trainer does."""
    prompts = [render_example(tokenizer, e, settings.system_prompt) for e in examples]
    completions, planted = zip(*(sft_completion(e, rng, settings.planted_fraction) for e in examples))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    rows = []
    for p, c in zip(prompt_ids, completion_ids):
        target = c + [tokenizer.eos_token_id]
        rows.append((p + target, [-100] * len(p) + target))
    return rows, sum(planted)


def bare_chain_text(rng: random.Random, mix: str, style: str = "chain") -> tuple[str, list[tuple[int, int]]]:
    """A chain of bare equations drawn like the mix's problems, and the character spans that are
    determined by what came before.

    style "chain": "28 + 28 = 56\n56 / 7 = 8\n"; determined: each result, each copied left operand.
    style "expression": "28 + 28 / 7\n28 + 28 = 56\n56 / 7 = 8\n"; the flat expression first, then the
    chain, all of which is determined (operands and operators copied from the expression, results
    computed): it practises finding the next number in earlier text and copying it, as a word problem needs.
    """
    level = rng.choice(MIXES[mix])
    steps = rng.randint(1, level.steps)
    chain = solution_chain(rng, steps, level.max_digits)
    text, spans = "", []
    if style == "expression":
        text = " ".join([str(chain[0].left)] + [f"{step.op} {step.right}" for step in chain]) + "\n"
        body = "".join(f"{step.left} {step.op} {step.right} = {step.result}\n" for step in chain)
        return text + body, [(len(text), len(text) + len(body))]
    for index, step in enumerate(chain):
        if index > 0:  # the left operand is the previous result, copied
            spans.append((len(text), len(text) + len(str(step.left))))
        text += f"{step.left} {step.op} {step.right} ="
        start = len(text)
        text += f" {step.result}\n"
        spans.append((start, len(text)))
    return text, spans


def bare_rows(tokenizer, rng: random.Random, settings: BuildSettings):
    """``bare_per_step`` bare arithmetic chains, ``BARE_CHAINS_PER_ROW`` packed into each row (short
    rows would be mostly padding), as (ids, labels) lists labelled only inside the determined spans."""
    rows = []
    for _ in range(0, settings.bare_per_step, BARE_CHAINS_PER_ROW):
        text, spans = "", []
        for _ in range(BARE_CHAINS_PER_ROW):
            chain, chain_spans = bare_chain_text(rng, settings.mix, settings.bare_style)
            spans += [(len(text) + s, len(text) + e) for s, e in chain_spans]
            text += chain
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        labels = [t if any(s <= start < e for s, e in spans) else -100
                  for t, (start, _) in zip(ids, encoded["offset_mapping"])]
        rows.append((ids, labels))
    return rows


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
            cache = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
            cache.batch_repeat_interleave(ids.shape[0])
        logits = model(input_ids=ids[:, skip:], attention_mask=mask, past_key_values=cache,
                       use_cache=cache is not None).logits[:, :-1]  # [b, L-skip-1, V]
        loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        labels[:, skip + 1:].reshape(-1), ignore_index=-100,
                                                        reduction="sum")
    return loss / max(total_tokens, 1)


def shared_prompt_prefix(tokenizer, system_prompt: str) -> list[int]:
    """Ids of what every rendered prompt starts with: the system turn and the user turn's opening."""
    probe = Example(messages=[{"role": "user", "content": "\x00"}], answer=None, answer_raw=None, source="probe")
    text = render_example(tokenizer, probe, system_prompt)
    return tokenizer(text[:text.index("\x00")], add_special_tokens=False)["input_ids"]


def tokenizer_corpus(settings: BuildSettings) -> list[str]:
    """Text the tokenizer is trained on: rendered prompts (system prompt, question, chat markup), full
    and planted completions, bare equations — everything the model will read or write, in the
    proportions it will see them (seeds disjoint from the held-out set)."""
    rng = random.Random(settings.seed)
    chat_template_only = build_tokenizer()  # renders the prompts; its own vocabulary is not used
    corpus = []
    for example in generate_problems(settings.tokenizer_problems, seed=500_000 + settings.seed, difficulty=settings.mix):
        chain = equations(example)
        corpus += [render_example(chat_template_only, example, settings.system_prompt),
                   completion_text(chain, example.answer),
                   completion_text(chain[:1], chain[0].split(" = ")[1]), bare_chain_text(rng, settings.mix)[0]]
    return corpus


def with_text_tags(tokenizer):
    """The same tokenizer with the answer tags (<think>, </answer>, ...) as ordinary added tokens.

    ``build_tokenizer`` registers them as *special* tokens, and the rollout engine decodes with
    ``skip_special_tokens=True``, which would delete the tags from every completion (format rate 0).
    Qwen's own <think> tokens are likewise added tokens that are not special. Still one token each.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    for added in state["added_tokens"]:
        if added["content"] in TAG_TOKENS:
            added["special"] = False
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = tokenizer.chat_template
    return wrapped


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
    fields = {f.name: f for f in dataclasses.fields(BuildSettings)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            parser.error(f"--set {item!r}: unknown setting {key!r}; known: {sorted(fields)}")
        overrides[key] = value if isinstance(getattr(BuildSettings(), key), str) else yaml.safe_load(value)
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
