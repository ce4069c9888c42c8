"""The rules that tie a config to its task and its data: ``data.task`` resolves, the rewards are well formed, and
the rewards and the task's scorer read the gold the data gives (``grpo.tasks.gold``). Each returns
``(key, why)`` pairs, as ``grpo.config.rules``' checks do (that module lists them in its ``RULES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.tasks import resolve_task
from grpo.tasks.gold import reward_problems_for_gold, task_problems_for_gold, training_problems_for_gold

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def task_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """data.task resolves to a task (a registered name, or a dotted path that imports and gives a
    ``grpo.tasks.Task``): checked with the config, not found mid-run when the data loads."""
    try:
        resolve_task(cfg.data.task, cfg.data.train)
    except (ValueError, TypeError) as err:
        return [("data.task", f"is {cfg.data.task!r}: {err}")]
    return []


def reward_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """At least one reward, and each entry's name, factory_args and columns. ``rewards`` None is a run whose task
    did not resolve (``task_problems`` says why), or a config that was never resolved."""
    if cfg.rewards is None:
        return [] if task_problems(cfg) else [("rewards", "is null in a config that was not resolved: build the "
                                                          "config with grpo.config.load_config or config_from_dict")]
    problems = []
    # an environment's get_reward, or a verifiers environment's task rewards, may be the only rewards
    if not cfg.rewards and not cfg.rollout.environment and not str(cfg.data.train).startswith("verifiers:"):
        problems.append(("rewards", "is empty (given as [], or the task's default rewards are none): GRPO "
                                    "needs at least one reward function"))
    for i, r in enumerate(cfg.rewards):
        if not r.name:
            problems.append((f"rewards[{i}].name", "is empty"))
        if r.factory_args is not None and ":" not in r.name:
            problems.append((f"rewards[{i}].factory_args", (
                f"is set but {r.name!r} is not a dotted path 'package.module:factory'; a built-in reward "
                "takes its settings in params")))
        for keyword, column in r.columns.items():
            if not (isinstance(keyword, str) and keyword.isidentifier() and isinstance(column, str)):
                problems.append((f"rewards[{i}].columns", (
                    f"maps {keyword!r} to {column!r}: each entry is keyword: column, both names (strings), "
                    "the keyword a valid Python identifier")))
    return problems


def gold_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The rewards read the gold data.train gives, the task asks for it, and the task's scorer (evaluation's
    accuracy) reads the gold of every data.eval set (``grpo.tasks.gold``). A reward whose ``columns`` feed it
    another column than ``answer`` reads what that column holds, which no source declares: not checked."""
    try:
        task = resolve_task(cfg.data.task, cfg.data.train)
    except (ValueError, TypeError):
        return []  # task_problems reports it
    gold_readers = [r.name if "answer" not in r.columns else "" for r in cfg.rewards or []]
    eval_sets = {"": cfg.data.eval} if isinstance(cfg.data.eval, str) else dict(cfg.data.eval or {})
    return (training_problems_for_gold(task, cfg.data.train)
            + reward_problems_for_gold(task, gold_readers, cfg.data.train)
            + task_problems_for_gold(task, eval_sets, "data.eval"))
