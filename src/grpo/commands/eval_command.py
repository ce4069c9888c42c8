"""``grpo eval``: resolve the model (folder, checkpoint or run folder), load its eval sets with the task,
evaluate each (``grpo.evaluation.evaluate``), print, write the JSON report and the per-example records.

What a run evaluates with comes from its ``config.yaml`` when there is one: the task (``data.task``), the
sets (``data.eval``, one or named), the rewards (``rewards``), the tools; each has an option that replaces it.
The report's ``metrics`` use the names the run logs (``eval/accuracy``, ``eval/<set>/pass@4``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from grpo.config import ConfigError, RewardConfig, RunConfig
from grpo.evaluation.evaluate import evaluate
from grpo.evaluation.example_records import EvalRewards, logged_metrics, write_records
from grpo.models.source import ModelSource, load_model_for_inference, resolve_model_source
from grpo.multiturn.wiring import turn_spec, with_turns
from grpo.rollout import LeanEngine
from grpo.tasks import Task, resolve_task, run_task
from grpo.tasks.gold import reward_problems_for_gold, task_problems_for_gold
from grpo.training.inputs import build_rewards

_SET_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def parse_data_sets(data: str | list[str] | dict[str, str] | None) -> dict[str, str] | None:
    """``--data`` values -> ``{set name: source}``: a bare source is the unnamed set ""; ``name=source`` a
    named one (a name is a word: ``gsm8k=openai/gsm8k``; ``synthetic:seed=1`` is a bare source). Several bare
    sources are an error (their metrics would share names)."""
    if data is None:
        return None
    if isinstance(data, dict):
        return dict(data)

    sets: dict[str, str] = {}
    for item in [data] if isinstance(data, str) else data:
        name, equals, source = item.partition("=")
        if not (equals and _SET_NAME.fullmatch(name)):
            name, source = "", item
        if name in sets:
            raise ConfigError(f"--data: set {name or '(unnamed)'} given twice; name them: --data NAME=SOURCE")
        sets[name] = source
    if "" in sets and len(sets) > 1:
        raise ConfigError("--data: name every set when there are several (NAME=SOURCE)")
    return sets


def _eval_rewards(config, rewards: list[str] | None, tag_style: str, examples) -> EvalRewards | None:
    """The run's rewards (``rewards`` in its config), or the named ones; None for none."""
    if rewards is not None:
        if not rewards:
            return None
        base = config or RunConfig()
        config = dataclasses.replace(base, rewards=[RewardConfig(name) for name in rewards],
                                     data=dataclasses.replace(base.data, tag_style=tag_style))
    if config is None or not config.rewards:
        return None
    functions, weights = build_rewards(config, examples)
    return EvalRewards(functions, weights)


def run_eval_command(
    model_path: str | Path,
    data: str | list[str] | dict[str, str] | None = None,
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
    task: str | None = None,
    rewards: list[str] | None = None,
    bootstrap: int = 0,
    max_samples_written: int | None = None,
) -> dict[str, Any]:
    """``grpo eval``: evaluate a model, checkpoint or run folder on its eval sets; print and save the report.

    data: a source string (file, folder, hub id, ``synthetic:seed=S,n=N``), a list of them as ``name=source``
    (``parse_data_sets``) or a ``{name: source}`` dict; None = the run's ``data.eval``. split: None = the run's
    ``data.eval_split``, else "test". task: a ``grpo.tasks`` name or dotted path; None = the run's
    (``data.task``), else by the first source. rewards: reward names applied to the greedy completions;
    None = the run's ``rewards`` (none without a run config); [] none. The system prompt and tag style are
    the run's (config.yaml), else the task's and "think". ``output`` gets the JSON report, ``records_output``
    one JSON line per example (several sets: one file each, ``<stem>-<set><suffix>``). ``tools``:
    'module:function' tools the model may call (None: the run's ``rollout.tools`` and ``rollout.environment``;
    [] none), run as in training (``grpo.multiturn``). bootstrap: resamples for 95% intervals (0: none).
    """
    source = resolve_model_source(model_path, base_model=base_model)
    config = source.config
    sets = eval_sets(model_path, config, data)
    if split is None:
        split = config.data.eval_split if config is not None else "test"
    the_task = eval_task(task, config, sets)
    check_eval_gold(the_task, sets, config, rewards)
    system_prompt = eval_system_prompt(source, the_task, own_task=task is not None)
    examples = {name: the_task.load(src, split, limit) for name, src in sets.items()}
    eval_rewards = _eval_rewards(config, rewards, source.tag_style, next(iter(examples.values())))
    model, tokenizer = load_model_for_inference(source, device, dtype)
    engine = _tool_engine(config, tools, model, tokenizer, batch_size)
    results, records = {}, {}
    for name, set_examples in examples.items():
        result = evaluate(model, tokenizer, set_examples, task=the_task, tag_style=source.tag_style,
                          system_prompt=system_prompt, add_system_prompt=system_prompt is not None,
                          batch_size=batch_size, max_new_tokens=max_new_tokens, samples=samples,
                          temperature=temperature, seed=seed, progress=progress, return_records=True,
                          engine=engine, rewards=eval_rewards, bootstrap=bootstrap, max_written=max_samples_written)
        records[name] = result.pop("records")
        results[name] = result
    report = {
        **results.get("", {}),  # one unnamed set: its metrics at the top
        **({"sets": results} if "" not in results else {}),
        "metrics": logged_metrics(results),
        "model": str(source.model_dir),
        "base_model": source.base_model,
        "data": sets.get("", sets),
        "split": split,
        "limit": limit,
        "task": the_task.name,
        "rewards": [f.name for f in eval_rewards.functions] if eval_rewards else [],
        "samples": samples,
        "temperature": temperature if samples > 1 else None,
        "bootstrap": bootstrap,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "tag_style": source.tag_style,
        "system_prompt": system_prompt,
        "tools": _tool_names(config, tools),
    }
    print_report(report)
    write_eval_outputs(report, records, output, records_output)
    return report


def eval_sets(model_path: str | Path, config: RunConfig | None,
              data: str | list[str] | dict[str, str] | None) -> dict[str, str]:
    """``{set name: source}`` of ``--data``, else of the run's ``data.eval``; a ConfigError when neither is."""
    sets = parse_data_sets(data)
    if sets is None:
        if config is None or config.data.eval is None:
            raise ConfigError(f"{model_path}: no data given and no run config with data.eval; pass the data "
                              "(a GSM8K file or folder, a hub id, or synthetic:seed=S,n=N)")
        sets = parse_data_sets(config.data.eval)
    return sets


def eval_task(task: str | None, config: RunConfig | None, sets: dict[str, str]) -> Task:
    """``--task``, else the run's (``data.task``), else the task of the first source."""
    try:
        return (resolve_task(task, next(iter(sets.values()))) if task is not None or config is None
                else run_task(config))
    except ValueError as error:
        raise ConfigError(f"--task: {error}") from None


def check_eval_gold(the_task: Task, sets: dict[str, str], config: RunConfig | None,
                    rewards: list[str] | None) -> None:
    """A ConfigError before anything loads when the task's scorer, or a reward applied to the completions (the
    run's, or ``--rewards``), cannot read the gold a set gives (``grpo.tasks.gold``): e.g. a K&K run's task on
    ``--data synthetic:...``, whose accuracy could never be right."""
    if rewards is not None:
        names = rewards
    else:  # the run's; one whose columns feed it another column than answer reads what no source declares
        names = [r.name for r in (config.rewards or []) if "answer" not in r.columns] if config is not None else []
    problems = task_problems_for_gold(the_task, sets, "--data")
    for source in sets.values():
        problems += reward_problems_for_gold(the_task, names, source, key="--rewards")
    if problems:
        key, why = problems[0]
        fix = "pass --task for the data's task" if key.startswith("--data") else "pass --rewards (none: --rewards alone)"
        raise ConfigError(f"{key} {why} ({fix})")


def eval_system_prompt(source: ModelSource, the_task: Task, own_task: bool) -> str | None:
    """The run's system prompt (None: none); with ``--task`` (``own_task``) or without a run config, the task's,
    unless the run set its own or turned it off."""
    config, run_prompt = source.config, source.system_prompt
    if not own_task and config is not None:
        return run_prompt
    own = config.data.system_prompt if config is not None else None
    system_prompt = own if own is not None else the_task.system_prompt(source.tag_style)
    if config is not None and not config.data.add_system_prompt:
        return None
    return system_prompt


def write_eval_outputs(report: dict[str, Any], records: dict[str, list], output: str | Path | None,
                       records_output: str | Path | None) -> None:
    """The JSON report to ``output`` and each set's records to ``records_output`` (named sets: one file each,
    ``<stem>-<set><suffix>``); None: not written."""
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if records_output is not None:
        records_output = Path(records_output)
        for name, rows in records.items():
            path = records_output if name == "" else records_output.with_name(
                f"{records_output.stem}-{name}{records_output.suffix}")
            write_records(path, rows)


def print_report(report: dict[str, Any], console=None) -> None:
    """A small rich table of the metrics in ``report``."""
    console = console or Console()
    table = Table(title=f"eval: {report.get('model', '')}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("data", "split", "task", "samples"):
        if report.get(key) is not None:
            table.add_row(key, str(report[key]))
    for key, value in report["metrics"].items():
        table.add_row(key, f"{value:.4f}")
    console.print(table)


def _tool_names(config, tools: list[str] | None) -> list[str]:
    if tools is not None:
        return list(tools)
    if config is None:
        return []
    return [*config.rollout.tools, *([config.rollout.environment] if config.rollout.environment else [])]


def _tool_engine(config, tools: list[str] | None, model, tokenizer, batch_size: int):
    """A multi-turn engine over the lean one when the run (or ``tools``) names tools or an environment; else None."""
    config = config or RunConfig()
    if tools is not None:
        rollout = dataclasses.replace(config.rollout, tools=list(tools), environment=None)
        config = dataclasses.replace(config, rollout=rollout)
    if not config.rollout.tools and not config.rollout.environment:
        return None
    return with_turns(LeanEngine(model, tokenizer, batch_size=batch_size), turn_spec(config), config, model,
                      tokenizer)
