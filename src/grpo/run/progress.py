"""A rich progress bar for training steps: step, reward, accuracy, KL and ETA."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StepProgress:
    """Context manager; ``update(step, metrics)`` after each step. Disabled -> does nothing."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.total, self.start = total_steps, start_step
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, stats="")
        return self

    def update(self, step: int, metrics: dict) -> None:
        """Advance to ``step`` and show its reward, accuracy, KL (and eval accuracy if present)."""
        if not self._progress:
            return
        stats = (f"reward {metrics.get('reward/mean', float('nan')):+.3f}  "
                 f"acc {metrics.get('accuracy', float('nan')):.2f}  kl {metrics.get('kl', float('nan')):.4f}")
        if "eval/accuracy" in metrics:
            stats += f"  eval {metrics['eval/accuracy']:.2f}"
        self._progress.update(self._task, completed=step, stats=stats)

    def __exit__(self, *exc):
        if self._progress:
            self._progress.__exit__(*exc)
        return False
