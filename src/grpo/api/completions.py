"""TRL 1.16's ``log_completions``: at each log, the latest generation's completions printed as a table (a random
``num_completions_to_print`` of them, all when None) and written to
``<output_dir>/completions/completions_<global_step:05d>.parquet`` (columns step, prompt, completion, one per
reward, the ``log_extra`` columns, advantage). Prompts and completions are as the rewards saw them: chat
messages for conversational data, a multi-turn completion with its assistant turns, ``tool_calls`` and ``tool``
results, so a reader sees what the tools returned; strings for plain-text prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from grpo.step.records import RolloutBatch


@dataclass
class CompletionTable:
    """One generation's rows as TRL logs them: N prompts, completions and advantages; reward name -> N values
    (NaN where the function abstained); ``log_extra`` column -> N values."""

    prompt: list
    completion: list
    rewards: dict[str, list]
    extras: dict[str, list]
    advantage: list[float]


def completion_table(batch: RolloutBatch) -> CompletionTable:
    """The batch's completions as TRL's table. A batch without ``chat_prompts`` (a decoupled sampler's) shows
    its rendered prompts and decoded completions."""
    n = len(batch.generation.completions)
    group = n // max(len(batch.prompts), 1)
    prompts = batch.chat_prompts or [batch.prompts[i // group] for i in range(n)]
    completions = batch.chat_completions or batch.generation.messages or list(batch.generation.completions)
    advantages = batch.advantages.double()
    if advantages.dim() == 2:  # per-token (gae): the mean over the completion's sampled tokens
        mask = batch.generation.sampled_mask.double()
        advantages = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    parts = batch.reward_parts.double().tolist()
    return CompletionTable(list(prompts), list(completions),
                           {name: [row[f] for row in parts] for f, name in enumerate(batch.reward_names)},
                           {column: list(values) for column, values in batch.reward_extras.items()},
                           advantages.tolist())


def log_completions(table: CompletionTable, step: int, output_dir: str | Path, num_to_print: int | None) -> Path:
    """Print ``table`` as TRL's panel and write its parquet file; returns the file."""
    print_table(table, step, num_to_print)
    folder = Path(output_dir) / "completions"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"completions_{step:05d}.parquet"
    frame = {"step": [step] * len(table.prompt), "prompt": table.prompt, "completion": table.completion,
             **table.rewards, **table.extras, "advantage": table.advantage}
    pd.DataFrame(frame).to_parquet(path)
    return path


def print_table(table: CompletionTable, step: int, num_to_print: int | None) -> None:
    """TRL's panel: a row per completion (a random ``num_to_print`` of them; None: all)."""
    rows = list(range(len(table.prompt)))
    if num_to_print is not None and num_to_print <= 0:
        return
    if num_to_print is not None and num_to_print < len(rows):
        rows = sorted(random.Random(step).sample(rows, num_to_print))
    out = Table(show_header=True, header_style="bold white", expand=True)
    out.add_column("Prompt", style="bright_yellow")
    out.add_column("Completion", style="bright_green")
    for name in table.rewards:
        out.add_column(name, style="bold cyan", justify="right")
    out.add_column("Advantage", style="bold magenta", justify="right")
    for name in table.extras:
        out.add_column(name, style="bright_white")
    for i in rows:
        out.add_row(entry_text(table.prompt[i]), entry_text(table.completion[i]),
                    *[_number(values[i]) for values in table.rewards.values()], _number(table.advantage[i]),
                    *[entry_text(values[i]) for values in table.extras.values()])
        out.add_section()
    Console().print(Panel(out, expand=False, title=f"Step {step}", border_style="bold white"))


def _number(value: float | None) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def entry_text(entry):
    """A prompt or completion as TRL prints it: each message's ROLE, its content and its tool calls as
    ``name(arg=value, ...)``; anything else as its str()."""
    text = Text()
    if not (isinstance(entry, list) and all(isinstance(m, dict) for m in entry)):
        text.append(str(entry))
        return text
    for j, message in enumerate(entry):
        text.append(f"{message.get('role', '').upper()}\n", style="bold red")
        reasoning = message.get("reasoning_content") or message.get("thinking")
        if reasoning:
            text.append(reasoning, style="italic dim white")
            text.append("\n")
        content = message.get("content")
        if isinstance(content, str):
            text.append(content)
        elif isinstance(content, list):  # typed blocks
            for block in content:
                text.append(block["text"] if block.get("type") == "text" else "[IMAGE]")
        for k, call in enumerate(message.get("tool_calls") or []):
            if k > 0:
                text.append("\n")
            function = call.get("function", {})
            text.append(f"{function.get('name') or '?'}({_arguments_text(function.get('arguments'))})")
        if j < len(entry) - 1:
            text.append("\n\n")
    return text


def _arguments_text(raw) -> str:
    """``k=v, ...`` of a call's arguments (a dict, or its JSON); a malformed call's text as it came."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return raw
    if isinstance(raw, dict):
        return ", ".join(f"{k}={v!r}" for k, v in raw.items())
    return "" if raw is None else str(raw)
