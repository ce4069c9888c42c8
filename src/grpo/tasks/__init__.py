"""Tasks: problem families the trainer trains and evaluates on (``Task``: data, system prompt, scorer, rewards).

- ``task``:           the ``Task`` record
- ``builtin_tasks``:  ``gsm8k``, ``arithmetic`` and ``kk`` (the K&K puzzles are ``grpo.data.knights_knaves``)
- ``resolution``:     ``resolve_task`` (a built-in name, a dotted path, or by data source), a run's task
"""

from grpo.tasks.resolution import resolve_task, run_system_prompt, run_task, task_for_source, task_names
from grpo.tasks.task import Score, Task

__all__ = ["Score", "Task", "resolve_task", "run_system_prompt", "run_task", "task_for_source", "task_names"]
