"""Tasks: problem families the trainer trains and evaluates on (``Task``: data, system prompt, scorer, rewards).

- ``task``:           the ``Task`` record and ``resolve_task`` (a built-in name, a dotted path, or by data source)
- ``builtin``:        ``gsm8k``, ``arithmetic`` and ``kk``
- ``knights_knaves``: Knights-and-Knaves logic puzzles (the K&K benchmark of Xie et al., used by Logic-RL).
"""

from grpo.tasks.task import Score, Task, resolve_task, run_system_prompt, run_task, task_for_source, task_names

__all__ = ["Score", "Task", "resolve_task", "run_system_prompt", "run_task", "task_for_source", "task_names"]
