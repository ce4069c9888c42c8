"""Progress of the training steps: a rich bar (step, reward, accuracy, KL and ETA), or a line per step.

In a terminal the bar is rich's live display. In Jupyter that display needs ipywidgets (without it rich only
warns), and its cursor-moving escapes are not for a notebook, so there the bar is a notebook output (HTML and
plain text) replaced in place after each step: ``NotebookBar``.
"""

from __future__ import annotations

import io

import rich
from rich.console import Console
from rich.jupyter import JUPYTER_HTML_FORMAT
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class NotebookBar:
    """A rich renderable shown as one Jupyter output, redrawn by ``show()``: an IPython display handle
    updated in place, so the executed notebook keeps the last state and no control characters."""

    def __init__(self, renderable, width: int = 100):
        from IPython.display import display  # only inside a notebook

        self.renderable, self.width = renderable, width
        self._handle = display(self, display_id=True)

    def show(self) -> None:
        self._handle.update(self)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict[str, str]:
        console = Console(file=io.StringIO(), record=True, width=self.width, color_system="truecolor",
                          force_jupyter=False)
        console.print(self.renderable)
        html = console.export_html(inline_styles=True, code_format=JUPYTER_HTML_FORMAT, clear=False)
        return {"text/html": html, "text/plain": console.export_text().rstrip("\n")}


def in_notebook() -> bool:
    """Whether output goes to a Jupyter notebook (rich's own detection: an IPython kernel's shell)."""
    return rich.get_console().is_jupyter


class StepProgress:
    """Context manager; ``update(step, metrics)`` after each step. Disabled -> does nothing."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.total, self.start = total_steps, start_step
        self._progress = None
        self._task = None
        self._notebook: NotebookBar | None = None

    def __enter__(self):
        if self.enabled:
            notebook = in_notebook()
            self._progress = Progress(
                TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                auto_refresh=not notebook)
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, stats="")
            if notebook:
                self._notebook = NotebookBar(self._progress)
            else:
                self._progress.__enter__()
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
        if self._notebook:
            self._notebook.show()

    def __exit__(self, *exc):
        if self._notebook:
            self._progress.stop_task(self._task)  # the elapsed time stops at the last step
            self._notebook.show()
        elif self._progress:
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
