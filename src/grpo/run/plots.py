"""Training curves of a run folder, drawn from its ``metrics.jsonl`` into ``plots/*.png``.

Uses ``matplotlib.figure.Figure`` directly rather than pyplot: no global figure state and no GUI
backend, so plotting works on headless machines and inside a running trainer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from grpo.run.tracking import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"
_REWARD_AGGREGATES = ("reward/mean", "reward/std", "reward/mean_sq")  # not reward functions


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite number; ``None`` for null, missing or anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key``, skipping records without it and null/non-numeric values."""
    points = [(r["step"], v) for r in records if (v := _number(r.get(key))) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _line(ax: Axes, records: list[dict], key: str, **style) -> bool:
    steps, values = _series(records, key)
    if steps:
        ax.plot(steps, values, label=key, **style)
    return bool(steps)


def _draw_reward(ax: Axes, records: list[dict]) -> bool:
    """reward/mean with a ±reward/std band, and each reward function's ``reward/<name>``."""
    drawn = _line(ax, records, "reward/mean", linewidth=2, color="black")
    band = [(r["step"], mean, std) for r in records
            if (mean := _number(r.get("reward/mean"))) is not None
            and (std := _number(r.get("reward/std"))) is not None]
    if band:
        steps, means, stds = zip(*band)
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        color="gray", alpha=0.25, label="± reward/std")
        drawn = True
    per_function = {k for r in records for k in r if k.startswith("reward/") and k not in _REWARD_AGGREGATES
                    and not k.endswith("/std")}
    for key in sorted(per_function):
        drawn |= _line(ax, records, key, linewidth=1)
    return _finish(ax, "reward", drawn)


def _draw_accuracy(ax: Axes, records: list[dict]) -> bool:
    """Training ``accuracy`` and ``format_rate`` as lines, ``eval/accuracy`` as points."""
    drawn = _line(ax, records, "accuracy")
    drawn |= _line(ax, records, "eval/accuracy", linestyle="none", marker="o")
    drawn |= _line(ax, records, "format_rate")
    if drawn:
        ax.set_ylim(-0.02, 1.02)  # rates: a fixed scale makes runs comparable at a glance
    return _finish(ax, "accuracy", drawn)


def _draw_kl(ax: Axes, records: list[dict]) -> bool:
    return _finish(ax, "KL to the reference policy", _line(ax, records, "kl"))


def _draw_length(ax: Axes, records: list[dict]) -> bool:
    return _finish(ax, "completion length (tokens)", _line(ax, records, "completion_length/mean"))


def _finish(ax: Axes, title: str, drawn: bool) -> bool:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    return drawn


_PANELS: list[tuple[str, Callable[[Axes, list[dict]], bool]]] = [
    ("reward", _draw_reward),
    ("accuracy", _draw_accuracy),
    ("kl", _draw_kl),
    ("completion_length", _draw_length),
]


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Draw ``run_dir/metrics.jsonl`` into ``run_dir/plots/`` and return the PNG files written.

    One PNG per panel (``reward``, ``accuracy``, ``kl``, ``completion_length``) whose metrics were
    logged, and ``summary.png`` with all four panels in a 2x2 grid. The x axis is the step; null
    values are skipped. Raises ``FileNotFoundError`` naming the file when there is no metrics file,
    ``ValueError`` when it holds no records.
    """
    # On first use: matplotlib is 0.2 s of import that a run without plots never pays.
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("step"), int)]
    if not records:
        raise ValueError(f"{metrics_path} holds no metric records yet; nothing to plot")
    out = run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)

    written = []
    for name, draw in _PANELS:
        figure = Figure(figsize=(7, 4.5), layout="constrained")
        if draw(figure.add_subplot(), records):
            written.append(_save(figure, out / f"{name}.png"))

    summary = Figure(figsize=(13, 8.5), layout="constrained")
    for ax, (_, draw) in zip(summary.subplots(2, 2).flat, _PANELS):
        draw(ax, records)
    summary.suptitle(run_dir.resolve().name)
    written.append(_save(summary, out / "summary.png"))
    return written


@dataclass(frozen=True)
class RunPlots:
    """The PNGs ``plot_run`` wrote, ``summary.png`` last. A notebook cell that returns it shows the summary
    inline (IPython's ``_repr_png_``); elsewhere it is the list of files."""

    files: tuple[Path, ...]

    @property
    def summary(self) -> Path:
        return self.files[-1]

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def _repr_png_(self) -> bytes:
        return self.summary.read_bytes()


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=100)
    return path
