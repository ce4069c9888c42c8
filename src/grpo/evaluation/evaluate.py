"""Held-out evaluation: greedy answer accuracy and format rate, the run's rewards, and mean@k / pass@k / maj@k
from k samples, all scored by the run's task.

Data flow: Examples -> system prompt + history through the chat template (``grpo.data``) -> completions
from a rollout engine (``grpo.rollout``: the run's own in training, a lean one in ``grpo eval``) -> each
completion scored by the task (``grpo.tasks.Task.score``: the prediction, whether it is right, whether the
tags are) and the rewards (``grpo.evaluation.example_records``: one JSON record per example) -> metrics of the
records (``eval_scoring.summarize``).

``evaluate_records`` gives the records of some examples (a slice of a set, for one rank of several);
``evaluate`` is the whole of it for one set. ``grpo eval`` is ``grpo.commands.eval_command``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from grpo.data import Example, render_example
from grpo.data.prompts import build_prompt_messages
from grpo.data.tags import get_tag_style
from grpo.evaluation.example_records import EvalRewards, RewardInputs, example_records, reward_values, summarize
from grpo.evaluation.sample_metrics import pass_at_k
from grpo.multiturn.driver import ExampleRollout
from grpo.rewards.answers import final_text
from grpo.rollout import LeanEngine, RolloutEngine, SamplingParams
from grpo.rollout.generation import Generation
from grpo.run.progress import in_notebook
from grpo.tasks import Task
from grpo.tasks.builtin_tasks import BUILTIN_TASKS, numeric_score

__all__ = ["evaluate", "evaluate_records", "pass_at_k", "score_completion"]

score_completion = numeric_score  # the gsm8k task's scorer, by the name it had before tasks


@dataclass
class Generated:
    """One ``_generate_all``: [P * n] completions grouped per prompt, and what the rewards see of them."""

    texts: list[str] = field(default_factory=list)  # the final answer text (a multi-turn one's last message)
    truncated: list[bool] = field(default_factory=list)
    completions: list = field(default_factory=list)  # as rewards get them: messages, or strings
    completion_ids: list[list[int]] = field(default_factory=list)  # tokens up to and including EOS
    chat_prompts: list = field(default_factory=list)  # multi-turn: as the engine gave them to its rewards
    environments: list = field(default_factory=list)  # multi-turn: one per row, when the run has environments
    rollout_metrics: list[dict] = field(default_factory=list)  # per call, with its "rows"


def _generate_all(engine: RolloutEngine, prompts: list[str], params: SamplingParams, batch_size: int,
                  seed: int | None, progress, description: str, turns: tuple | None = None,
                  first_call: int = 0) -> Generated:
    """Completions (``len(prompts) * params.n``, grouped per prompt) in calls of at most ``batch_size``
    completions, advancing a progress task by the prompts done.

    ``turns``: ``(examples, system_prompt, max_prompt_length)`` when ``engine`` makes multi-turn rollouts
    (``grpo.multiturn``: tools run as in training); a completion's text is then its last assistant message.
    ``first_call``: the index of this slice's first call in the whole set's (the calls' seeds follow it)."""
    prompts_per_call = max(1, batch_size // params.n)
    task = progress.add_task(description, total=len(prompts))
    out = Generated()
    for call, start in enumerate(range(0, len(prompts), prompts_per_call)):
        chunk = prompts[start:start + prompts_per_call]
        # One seed per call of the whole set, so a chunk's samples do not depend on the calls before it, nor
        # on which rank makes it.
        call_seed = None if seed is None else seed + first_call + call
        done = len(out.texts)
        if turns is not None:
            examples, system_prompt, max_prompt_length = turns
            result = engine.rollout(examples[start:start + prompts_per_call], system_prompt, max_prompt_length,
                                    params, call_seed)
            generation: Generation = result.generation
            out.texts.extend(final_text(m) for m in generation.messages)  # as the rewards read it
            out.completions.extend(generation.messages)
            out.chat_prompts.extend(result.chat_prompts)
            out.environments.extend(result.environments or [])
            out.rollout_metrics.append({**generation.rollout_metrics, "rows": len(generation.messages)})
        else:
            generation = engine.generate(chunk, params, seed=call_seed)
            out.texts.extend(generation.completions)
        if len(out.texts) - done != len(chunk) * params.n:
            raise RuntimeError(f"rollout engine returned {len(out.texts) - done} completions for "
                               f"{len(chunk)} prompts x {params.n}")
        out.truncated.extend(bool(t) for t in generation.truncated.tolist())
        out.completion_ids.extend(ids[mask.bool()].tolist()
                                  for ids, mask in zip(generation.completion_ids, generation.completion_mask))
        progress.advance(task, len(chunk))
    return out


def mean_rollout_metrics(chunks: list[dict]) -> dict[str, float]:
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


def call_unit(batch_size: int, samples: int) -> int:
    """The examples a slice of a set must start at a multiple of, so that its greedy and sampled calls are
    the whole set's (the same prompts together, the same seeds): a rank's slice then gives the records the
    whole set's evaluation gives for those examples."""
    return math.lcm(batch_size, max(1, batch_size // samples))


def _reward_inputs(examples: Sequence[Example], system_prompt: str | None, greedy: Generated) -> RewardInputs:
    """The greedy completions as training's rewards see them (``grpo.step.experience.sample_and_score``)."""
    if greedy.chat_prompts:  # multi-turn: the engine's own
        prompts, completions = greedy.chat_prompts, greedy.completions
    else:
        prompts = [e.question if e.plain_text else build_prompt_messages(e, system_prompt) for e in examples]
        completions = [t if e.plain_text else [{"role": "assistant", "content": t}]
                       for e, t in zip(examples, greedy.texts)]
    columns: dict[str, list] = {}
    for e in examples:
        for key, value in e.columns().items():
            columns.setdefault(key, []).append(value)
    if greedy.environments:
        columns["environments"] = greedy.environments
    return RewardInputs(prompts, completions, greedy.completion_ids, columns)


def evaluate_records(
    model: torch.nn.Module | None,
    tokenizer,
    examples: Sequence[Example],
    *,
    task: Task | None = None,
    tag_style: str = "think",
    system_prompt: str | None = None,
    add_system_prompt: bool = True,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    samples: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    engine: RolloutEngine | None = None,
    max_prompt_length: int = 1 << 30,
    rewards: EvalRewards | None = None,
    max_written: int | None = None,
    first_example: int = 0,
) -> tuple[list[dict[str, Any]], list[dict]]:
    """The records (``grpo.evaluation.example_records.example_records``) of ``examples`` and the rollout engine's
    per-call metrics (multi-turn: tool calls; row-weighted by ``mean_rollout_metrics``). Arguments as
    ``evaluate``'s; ``first_example``: the index of ``examples[0]`` in its whole set, a multiple of
    ``call_unit(batch_size, samples)`` (a rank's slice: the seeds of its calls are the whole set's)."""
    task = task or BUILTIN_TASKS["gsm8k"]
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"evaluate: samples={samples} needs temperature > 0 (at 0 every sample is the greedy one)")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    if first_example % call_unit(batch_size, samples):
        raise ValueError(f"evaluate: a slice must start at a multiple of {call_unit(batch_size, samples)}, "
                         f"got {first_example}")
    unanswered = [e.source for e in examples if e.answer is None]
    if unanswered:
        raise ValueError(f"evaluate: {len(unanswered)} example(s) have no gold answer, e.g. {unanswered[0]}; "
                         "accuracy needs an answer column")
    get_tag_style(tag_style)  # an unknown style fails here, listing the known ones
    if not examples:
        return [], []
    # null: the task's own (K&K asks for roles, the numeric tasks for a number); none without add_system_prompt
    system_prompt = (None if not add_system_prompt else
                     system_prompt if system_prompt is not None else task.system_prompt(tag_style))
    if engine is None:
        engine = LeanEngine(model, tokenizer, batch_size=batch_size)

    turns = (examples, system_prompt, max_prompt_length) if isinstance(engine, ExampleRollout) else None
    prompts = ([e.question for e in examples] if turns is not None  # rendered by the engine, with the tools
               else [render_example(tokenizer, e, system_prompt) for e in examples])

    # Transient, so nothing of it stays; in a notebook rich's live display would only warn (grpo.run.progress).
    bar = Progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), disable=not progress or in_notebook(), transient=True)
    with bar:
        greedy = _generate_all(engine, prompts, SamplingParams(n=1, max_tokens=max_new_tokens, greedy=True),
                               batch_size, None, bar, "greedy", turns)
        sample_texts: list[str] = []
        if samples > 1:
            sample_params = SamplingParams(n=samples, max_tokens=max_new_tokens, temperature=temperature)
            with _rng_fork(model):
                sample_texts = _generate_all(engine, prompts, sample_params, batch_size, seed, bar,
                                             f"{samples} samples, T={temperature:g}", turns,
                                             first_call=first_example // max(1, batch_size // samples)).texts
    values = reward_values(rewards, _reward_inputs(examples, system_prompt, greedy)) if rewards else None
    records = example_records(task, examples, tag_style, greedy.texts, greedy.truncated, sample_texts, samples,
                              values, max_written, greedy_lengths=[len(ids) for ids in greedy.completion_ids])
    return records, greedy.rollout_metrics


def evaluate(
    model: torch.nn.Module | None,
    tokenizer,
    examples: Sequence[Example],
    *,
    task: Task | None = None,
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
    rewards: EvalRewards | None = None,
    bootstrap: int = 0,
    max_written: int | None = None,
) -> dict[str, Any]:
    """Evaluate a model on examples with gold answers.

    Args:
        model, tokenizer: the policy (any train/eval mode; sampling runs in eval mode) and its tokenizer.
        examples: Examples whose ``answer`` is set.
        task: scores the completions and groups the examples (``grpo.tasks``); None: the gsm8k task.
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
        rewards: reward functions applied to the greedy completions (``reward/<name>``, ``reward/total``).
        bootstrap: resamples for 95% intervals of accuracy, pass@j and maj@k (0: none).
        max_written: sampled completions kept per record (None: all).

    Returns:
        ``eval_scoring.summarize``'s metrics (``n``, ``accuracy``, ``format_rate``, ``truncated_rate``, per
        group, rewards, with k > 1 ``mean@k``/``pass@j``/``maj@k``), the multi-turn tool metrics, and
        ``records`` when asked.
    """
    if not examples:
        raise ValueError("evaluate: no examples")
    records, chunks = evaluate_records(
        model, tokenizer, examples, task=task, tag_style=tag_style, system_prompt=system_prompt,
        add_system_prompt=add_system_prompt, batch_size=batch_size, max_new_tokens=max_new_tokens,
        samples=samples, temperature=temperature, seed=seed, progress=progress, engine=engine,
        max_prompt_length=max_prompt_length, rewards=rewards, max_written=max_written)
    metrics: dict[str, Any] = {**summarize(records, samples, bootstrap, seed), **mean_rollout_metrics(chunks)}
    if return_records:
        metrics["records"] = records
    return metrics
