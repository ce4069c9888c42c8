"""Progress of the training steps: a rich bar (step, reward, accuracy, KL and ETA), or a line per step."""

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


class LineProgress:
    """One printed line per step (reward, loss, KL, the batch trained): for processes whose output goes to a
    log, such as the decoupled trainer role under its launcher. Disabled -> does nothing."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        return self

    def update(self, step: int, metrics: dict) -> None:
        if self.enabled:
            batch = f" batch {metrics['batch_id']}" if "batch_id" in metrics else ""
            print(f"step {step}: reward {metrics['reward/mean']:+.3f} loss {metrics['loss']:+.4f} "
                  f"kl {metrics['kl']:.4f}{batch}", flush=True)

    def __exit__(self, *exc):
        return False
