"""One resolution of a run: a recipe, its ``key=value`` overrides and the task its data chooses -> the checked
``RunConfig``. Every entry point resolves through here (``grpo config``, ``grpo train``, the decoupled roles,
``grpo memory``, the Python API's ``GRPOConfig`` mapping), so the command that shows a run and the command that runs
it cannot disagree.

The order, lowest first: the schema's defaults; the recipe (``configs/demo-cpu.yaml`` when the command line names
none and it is there: grpo's default recipe); the overrides; then the task (``data.task``, else the task of
``data.train``) fills what none of them set: its default rewards now, its system prompt, answer format and scorer
when the run reads them (``grpo.tasks``). What the user set is never replaced. The default recipe is not the user's:
its keys that belong to its own task (``TASK_KEYS``: its rewards, its held-out sets) are set aside when the
overrides train another task, and the notes say so. Last, the cross-field rules (``grpo.config.rules``), among them
that every reward and the task's scorer read the gold the data gives.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from grpo.config.loader import (
    build_config,
    dump_config,
    locator,
    parse_override,
    read_recipe,
    set_dotted,
)
from grpo.config.rules import config_problems
from grpo.config.schema import DataConfig, RewardConfig, RunConfig
from grpo.data.gold_kinds import describe_gold
from grpo.errors import ConfigError
from grpo.tasks import Task, resolve_task

# The recipe a command runs when given none (`make demo`), relative to where it runs (a checkout); without it the
# schema's defaults.
DEFAULT_RECIPE = Path("configs/demo-cpu.yaml")
# The keys of a recipe that belong to the task it was written for: set aside from the default recipe when the
# overrides train another task (a user's own recipe keeps them, and its rules say what does not fit).
TASK_KEYS = ("rewards", "data.eval", "data.task", "data.system_prompt", "train.best_metric",
             "train.early_stop_accuracy")


@dataclass(frozen=True)
class ResolvedRun:
    """A resolved run: its config and how it was made.

    recipe:         the recipe read (None: the schema's defaults alone).
    default_recipe: ``recipe`` is grpo's default recipe (the command line named none).
    set_aside:      the default recipe's ``TASK_KEYS`` not used, as its task is not the run's.
    recipe_task:    the default recipe's own task (when ``set_aside``).
    """

    config: RunConfig
    recipe: Path | None = None
    default_recipe: bool = False
    set_aside: tuple[str, ...] = ()
    recipe_task: str | None = None

    def notes(self) -> list[str]:
        """What a user should be told about how the run was made (empty when nothing surprising happened)."""
        if not self.set_aside:
            return []
        cfg, task = self.config, run_task_name(self.config)
        rewards = ", ".join(f"{r.name} {r.weight:g}" for r in cfg.rewards or []) or "none"
        held_out = "no held-out set (set data.eval)" if cfg.data.eval is None else f"data.eval {cfg.data.eval}"
        return [f"no recipe given: {self.recipe} (grpo's default recipe, task {self.recipe_task}) with the "
                f"overrides; the run's task is {task}, so the recipe's {', '.join(self.set_aside)} (for "
                f"{self.recipe_task}) are not used: rewards {rewards} (the task's), {held_out}"]


def resolve_run(recipe: str | Path | None = None, overrides: Iterable[str] = (), *,
                default_recipe: Path | None = DEFAULT_RECIPE) -> ResolvedRun:
    """The run of a command line: ``recipe`` (None: ``default_recipe`` if that file exists, else the schema's
    defaults) with ``overrides`` (``section.key=value``), resolved (module docstring).

    Raises:
        ConfigError: unknown key (with a suggestion), wrong type, out-of-range value, invalid YAML, or a broken
            rule; the message names the file and line or the override, and the key.
    """
    use_default = recipe is None and default_recipe is not None and default_recipe.is_file()
    path = Path(recipe) if recipe is not None else (default_recipe if use_default else None)
    tree, lines = read_recipe(path) if path is not None else ({}, {})
    recipe_task = _tree_task(tree) if use_default else None
    origin: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        origin[key] = f"override {text!r}: "
    set_aside: tuple[str, ...] = ()
    if recipe_task is not None and _tree_task(tree) not in (None, recipe_task):
        set_aside = _drop_recipe_keys(tree, TASK_KEYS, overridden=origin)
    config = _resolved(tree, locator(path, lines, origin))
    return ResolvedRun(config, path, use_default, set_aside, recipe_task if set_aside else None)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """The resolved ``RunConfig`` of a recipe file (None: the schema's defaults; no default recipe) and overrides:
    ``resolve_run`` without the command line's default recipe (a run folder's ``config.yaml``, tests, tools)."""
    return resolve_run(path, overrides, default_recipe=None).config


def config_from_dict(tree: dict, source: str) -> RunConfig:
    """The resolved ``RunConfig`` of a nested dict (``config_to_dict``'s shape; missing keys keep their defaults;
    ``rewards`` None or absent: the task's); errors name ``source`` and the key, e.g. ``GRPOConfig: loss.beta
    ...`` (the Python API's arguments)."""
    return _resolved(copy.deepcopy(tree), lambda key: f"{source}: ")


def _resolved(tree: dict, where: Callable[[str], str]) -> RunConfig:
    """Build, fill from the task, check: a ConfigError on the first broken rule (``where(key)`` says where the key
    was set), listing the others."""
    config = with_task_values(build_config(tree, where))
    problems = config_problems(config)
    if problems:
        key, why = problems[0]
        more = "".join(f"\n  also: {k} {w}" for k, w in problems[1:])
        raise ConfigError(f"{where(key)}{key} {why}{more}")
    return config


def with_task_values(config: RunConfig) -> RunConfig:
    """``config`` with what it left unset filled from its task: the rewards (``Task.rewards``) when ``rewards`` is
    null. A ``data.task`` that does not resolve leaves it as it is (the rules report it)."""
    if config.rewards is not None:
        return config
    try:
        task = resolve_task(config.data.task, config.data.train)
    except (ValueError, TypeError):
        return config
    return dataclasses.replace(config, rewards=[RewardConfig(name, float(weight)) for name, weight in task.rewards])


def run_task_name(config: RunConfig) -> str:
    return resolve_task(config.data.task, config.data.train).name


def task_provenance(config: RunConfig) -> list[str]:
    """Lines saying which task a resolved run trains and which of its values are that task's (the header of
    ``config.yaml`` and of ``grpo config``)."""
    task = resolve_task(config.data.task, config.data.train)
    chosen = f"data.task {config.data.task}" if config.data.task else f"data.train {config.data.train}"
    from_task = []
    if config.rewards == [RewardConfig(name, float(weight)) for name, weight in task.rewards]:
        listed = ", ".join(f"{name} {weight:g}" for name, weight in task.rewards) or "none"
        from_task.append(f"rewards ({listed})")
    if config.data.add_system_prompt and config.data.system_prompt is None:
        from_task.append(_system_prompt_words(task, config.data.tag_style))
    if config.data.eval is not None:
        from_task.append("evaluation's scoring of data.eval" + (f" ({_gold(task)})" if task.gold else ""))
    return [f"task: {task.name} (chosen by {chosen})",
            f"from the task: {'; '.join(from_task) if from_task else 'nothing (the recipe and overrides set it all)'}"]


def run_config_text(config: RunConfig, path: str | Path | None = None) -> str:
    """A resolved config as ``config.yaml`` holds it: what made it (``task_provenance``) as comments, then every
    key; written to ``path`` when given."""
    header = ["The resolved config of a grpo run: every key (reloadable as a recipe).", *task_provenance(config)]
    return dump_config(config, path, header=header)


def _system_prompt_words(task: Task, tag_style: str) -> str:
    return (f"the system prompt (the task's, in data.tag_style {tag_style})" if task.system_prompt(tag_style)
            else "no system turn (the task adds none; its examples carry their own)")


def _gold(task: Task) -> str:
    return describe_gold(task.gold)


def _tree_task(tree: dict) -> str | None:
    """The name of the task a config tree trains (its data.task, else its data.train's); None when it does not
    resolve (the rules report that)."""
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    try:
        return resolve_task(data.get("task"), data.get("train", DataConfig.train)).name
    except (ValueError, TypeError, AttributeError):
        return None


def _drop_recipe_keys(tree: dict, keys: Iterable[str], overridden: dict[str, str]) -> tuple[str, ...]:
    """Remove from ``tree`` each of ``keys`` that it holds and no override set (an override of the key, of its
    section or inside it); returns those removed, in ``keys``' order."""
    dropped = []
    for key in keys:
        if any(o == key or key.startswith(o + ".") or o.startswith(key + ".") for o in overridden):
            continue
        *sections, last = key.split(".")
        node = tree
        for name in sections:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            del node[last]
            dropped.append(key)
    return tuple(dropped)


__all__ = ["DEFAULT_RECIPE", "TASK_KEYS", "ResolvedRun", "config_from_dict", "load_config",
           "resolve_run", "run_config_text", "task_provenance", "with_task_values"]
