"""Held-out evaluation: greedy answer accuracy and format rate, and pass@k from k samples.

Data flow: Examples -> system prompt + history through the chat template (``grpo.data``) ->
completions from a rollout engine (``grpo.rollout``) -> the answer in the ``<answer>`` tags compared
with the gold (``grpo.rewards.answers``, the same helpers the rewards use, so a metric and the reward
it mirrors cannot disagree) -> metrics.

``evaluate`` works on a loaded model (the trainer calls it between steps); ``run_eval_command`` is
the ``grpo eval`` job: resolve the model, load data and model, evaluate, print, write JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo.data import Example, load_dataset_source, render_example, resolve_system_prompt
from grpo.data.tags import get_tag_style
from grpo.rewards import answers_equal, extract_answer, is_well_formatted
from grpo.rewards.answers import final_text
from grpo.rollout import LeanEngine, RolloutEngine, SamplingParams
from grpo.step.records import Generation
from grpo.tools.sample_metrics import majority_answer, pass_at_k, sample_metrics

__all__ = ["evaluate", "pass_at_k", "run_eval_command", "score_completion"]


def score_completion(text: str, gold: str, tag_style: str) -> dict[str, Any]:
    """The tagged answer of one completion, whether it equals ``gold``, and whether it is well formatted."""
    prediction = extract_answer(text, tag_style)
    return {
        "prediction": prediction,
        "correct": answers_equal(prediction, gold),
        "formatted": is_well_formatted(text, tag_style),
    }


def _generate_all(engine: RolloutEngine, prompts: list[str], params: SamplingParams, batch_size: int,
                  seed: int | None, progress, description: str,
                  turns: tuple | None = None) -> tuple[list[str], list[bool], list[dict]]:
    """Completions (``len(prompts) * params.n``, grouped per prompt) in calls of at most ``batch_size``
    completions, advancing a progress task by the prompts done; and each call's rollout metrics.

    ``turns``: ``(examples, system_prompt, max_prompt_length)`` when ``engine`` makes multi-turn rollouts
    (``grpo.multiturn``: tools run as in training); a completion is then its last assistant message (the
    final answer; the tool calls and results before it are in the records' messages)."""
    prompts_per_call = max(1, batch_size // params.n)
    task = progress.add_task(description, total=len(prompts))
    texts: list[str] = []
    truncated: list[bool] = []
    rollout_metrics: list[dict] = []
    for call, start in enumerate(range(0, len(prompts), prompts_per_call)):
        chunk = prompts[start:start + prompts_per_call]
        # One seed per call, so a chunk's samples do not depend on how many calls came before it.
        call_seed = None if seed is None else seed + call
        if turns is not None:
            examples, system_prompt, max_prompt_length = turns
            generation: Generation = engine.rollout(examples[start:start + prompts_per_call], system_prompt,
                                                    max_prompt_length, params, call_seed).generation
            texts.extend(final_text(m) for m in generation.messages)  # as the rewards read it
            rollout_metrics.append({**generation.rollout_metrics, "rows": len(generation.messages)})
        else:
            generation = engine.generate(chunk, params, seed=call_seed)
            texts.extend(generation.completions)
        if len(texts) - len(truncated) != len(chunk) * params.n:
            raise RuntimeError(f"rollout engine returned {len(texts) - len(truncated)} completions for "
                               f"{len(chunk)} prompts x {params.n}")
        truncated.extend(bool(t) for t in generation.truncated.tolist())
        progress.advance(task, len(chunk))
    return texts, truncated, rollout_metrics


def _mean_rollout_metrics(chunks: list[dict]) -> dict[str, float]:
    """Row-weighted means of the calls' rollout metrics (``tools/calls_per_completion``, ...)."""
    rows = sum(c["rows"] for c in chunks)
    names = sorted({k for c in chunks for k in c if k != "rows"})
    return {k: sum(c.get(k, 0.0) * c["rows"] for c in chunks) / rows for k in names} if rows else {}


def _rng_fork(model: torch.nn.Module | None):
    """Keep the caller's RNG streams untouched by the sampling seed (the trainer evaluates mid-run)."""
    if model is None:
        return torch.random.fork_rng(devices=[])
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def evaluate(
    model: torch.nn.Module | None,
    tokenizer,
    examples: Sequence[Example],
    *,
    tag_style: str = "think",
    system_prompt: str | None = None,
    add_system_prompt: bool = True,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    samples: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    return_records: bool = False,
    engine: RolloutEngine | None = None,
    max_prompt_length: int = 1 << 30,
) -> dict[str, Any]:
    """Evaluate a model on examples with gold answers.

    Args:
        model, tokenizer: the policy (any train/eval mode; sampling runs in eval mode) and its tokenizer.
        examples: Examples whose ``answer`` is set.
        tag_style: "think" | "reasoning": which tags the answer is read from and the format checked.
        system_prompt: the system turn; None = the tag style's default.
        add_system_prompt: False: no system turn (the run's ``data.add_system_prompt``).
        batch_size: completions per generate() call.
        max_new_tokens: completion length limit (a completion that hits it counts as truncated).
        samples: k; when k > 1, k completions per problem are also sampled at ``temperature``.
        seed: seed of the sampled completions (the caller's RNG state is restored afterwards).
        progress: show a rich progress bar.
        return_records: add ``records``, one JSON-ready dict per example (completion, prediction, ...).
        engine: the rollout engine; default ``LeanEngine(model, tokenizer, batch_size)``
            (its greedy output equals generate()'s). One that makes rollouts from the examples
            (``grpo.multiturn``: tools, environments) is used that way: the tools run as in training, the
            answer is read from each completion's last assistant message, and the tool metrics are returned
            (``tools/calls_per_completion``, ...; of the greedy completions).
        max_prompt_length: longest rendered prompt (with its tools) a multi-turn engine accepts.

    Returns:
        ``n``; ``accuracy`` and ``format_rate`` of the greedy completions; ``truncated_rate`` (greedy
        completions that hit max_new_tokens); with k > 1 also ``pass@k`` (problems where at least one
        of the k samples is correct), ``mean_sample_accuracy`` and ``sample_format_rate``.
    """
    if not examples:
        raise ValueError("evaluate: no examples")
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"evaluate: samples={samples} needs temperature > 0 (at 0 every sample is the greedy one)")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    unanswered = [e.source for e in examples if e.answer is None]
    if unanswered:
        raise ValueError(f"evaluate: {len(unanswered)} example(s) have no gold answer, e.g. {unanswered[0]}; "
                         "accuracy needs an answer column")
    get_tag_style(tag_style)  # an unknown style fails here, listing the known ones
    system_prompt = resolve_system_prompt(system_prompt, tag_style, add_system_prompt)
    if engine is None:
        engine = LeanEngine(model, tokenizer, batch_size=batch_size)
    from grpo.multiturn.driver import ExampleRollout

    turns = (examples, system_prompt, max_prompt_length) if isinstance(engine, ExampleRollout) else None
    prompts = ([e.question for e in examples] if turns is not None  # rendered by the engine, with the tools
               else [render_example(tokenizer, e, system_prompt) for e in examples])
    golds = [e.answer for e in examples]

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), disable=not progress, transient=True)
    with bar:
        greedy_params = SamplingParams(n=1, max_tokens=max_new_tokens, greedy=True)
        greedy_texts, greedy_truncated, greedy_rollouts = _generate_all(engine, prompts, greedy_params, batch_size,
                                                                        None, bar, "greedy", turns)
        sample_texts: list[str] = []
        if samples > 1:
            sample_params = SamplingParams(n=samples, max_tokens=max_new_tokens, temperature=temperature)
            with _rng_fork(model):
                sample_texts, _, _ = _generate_all(engine, prompts, sample_params, batch_size, seed, bar,
                                                   f"{samples} samples, T={temperature:g}", turns)

    greedy_scores = [score_completion(t, g, tag_style) for t, g in zip(greedy_texts, golds)]
    n = len(examples)
    metrics: dict[str, Any] = {
        "n": n,
        "accuracy": sum(s["correct"] for s in greedy_scores) / n,
        "format_rate": sum(s["formatted"] for s in greedy_scores) / n,
        "truncated_rate": sum(greedy_truncated) / n,
        **_mean_rollout_metrics(greedy_rollouts),
    }
    sample_scores: list[list[dict[str, Any]]] = []
    if samples > 1:
        sample_scores = [[score_completion(t, golds[i], tag_style) for t in sample_texts[i * samples:(i + 1) * samples]]
                         for i in range(n)]
        correct_counts = [sum(s["correct"] for s in group) for group in sample_scores]
        # mean@k, unbiased pass@j for j = 1, 2, 4, ... k, and maj@k: the majority of the parsed answers
        majorities = [majority_answer([s["prediction"] for s in group], answers_equal) for group in sample_scores]
        metrics.update(sample_metrics([[s["correct"] for s in group] for group in sample_scores],
                                      [answers_equal(m, g) for m, g in zip(majorities, golds)]))
        metrics["mean_sample_accuracy"] = sum(correct_counts) / (n * samples)  # = mean@k (the name before it)
        metrics["sample_format_rate"] = sum(s["formatted"] for g in sample_scores for s in g) / (n * samples)
    if return_records:
        records = []
        for i, example in enumerate(examples):
            record = {"source": example.source, "question": example.question, "gold": example.answer,
                      "completion": greedy_texts[i], **greedy_scores[i], "truncated": greedy_truncated[i]}
            if samples > 1:
                record["sample_correct"] = sum(s["correct"] for s in sample_scores[i])
                record["sample_completions"] = sample_texts[i * samples:(i + 1) * samples]
            records.append(record)
        metrics["records"] = records
    return metrics


def print_report(report: dict[str, Any], console=None) -> None:
    """A small rich table of the metrics in ``report``."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"eval: {report.get('model', '')}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.4f}")
        elif key in ("n", "data", "split", "samples"):
            table.add_row(key, str(value))
    console.print(table)


def run_eval_command(
    model_path: str | Path,
    data: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    samples: int = 1,
    temperature: float = 1.0,
    output: str | Path | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    device: str = "auto",
    seed: int = 0,
    base_model: str | None = None,
    dtype: str | None = None,
    records_output: str | Path | None = None,
    progress: bool = True,
    tools: list[str] | None = None,
) -> dict[str, Any]:
    """``grpo eval``: evaluate a model, checkpoint or run folder on a data source; print and save the report.

    data: a data source string (file, folder, hub id, ``synthetic:seed=S,n=N``); None = the run's
    ``data.eval``. split: None = the run's ``data.eval_split``, else "test". The system prompt and tag
    style are the run's (config.yaml), else the "think" defaults. ``output`` gets the JSON report,
    ``records_output`` one JSON line per example (greedy completion, prediction, correctness).
    ``tools``: 'module:function' tools the model may call (None: the run's ``rollout.tools`` and
    ``rollout.environment``; [] none), run as in training (``grpo.multiturn``).
    """
    from grpo.config import ConfigError
    from grpo.models.source import load_model_for_inference, resolve_model_source

    source = resolve_model_source(model_path, base_model=base_model)
    if data is None:
        if source.config is None or source.config.data.eval is None:
            raise ConfigError(f"{model_path}: no data given and no run config with data.eval; pass the data "
                              "(a GSM8K file or folder, a hub id, or synthetic:seed=S,n=N)")
        data = source.config.data.eval
    if split is None:
        split = source.config.data.eval_split if source.config is not None else "test"
    examples = load_dataset_source(data, split=split, limit=limit)
    model, tokenizer = load_model_for_inference(source, device, dtype)
    engine = _tool_engine(source.config, tools, model, tokenizer, batch_size)
    result = evaluate(model, tokenizer, examples, tag_style=source.tag_style, system_prompt=source.system_prompt,
                      add_system_prompt=source.system_prompt is not None,
                      batch_size=batch_size, max_new_tokens=max_new_tokens, samples=samples,
                      temperature=temperature, seed=seed, progress=progress,
                      return_records=records_output is not None, engine=engine)
    records = result.pop("records", None)
    report = {
        **result,
        "model": str(source.model_dir),
        "base_model": source.base_model,
        "data": data,
        "split": split,
        "limit": limit,
        "samples": samples,
        "temperature": temperature if samples > 1 else None,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "tag_style": source.tag_style,
        "system_prompt": source.system_prompt,
        "tools": _tool_names(source.config, tools),
    }
    print_report(report)
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if records_output is not None:
        records_output = Path(records_output)
        records_output.parent.mkdir(parents=True, exist_ok=True)
        with records_output.open("w", encoding="utf-8") as handle:
            for record in records or []:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return report


def _tool_names(config, tools: list[str] | None) -> list[str]:
    if tools is not None:
        return list(tools)
    if config is None:
        return []
    return [*config.rollout.tools, *([config.rollout.environment] if config.rollout.environment else [])]


def _tool_engine(config, tools: list[str] | None, model, tokenizer, batch_size: int):
    """A multi-turn engine over the lean one when the run (or ``tools``) names tools or an environment; else None."""
    import dataclasses

    from grpo.config import RunConfig
    from grpo.multiturn.setup import turn_spec, with_turns

    config = config or RunConfig()
    if tools is not None:
        rollout = dataclasses.replace(config.rollout, tools=list(tools), environment=None)
        config = dataclasses.replace(config, rollout=rollout)
    if not config.rollout.tools and not config.rollout.environment:
        return None
    return with_turns(LeanEngine(model, tokenizer, batch_size=batch_size), turn_spec(config), config, model,
                      tokenizer)
