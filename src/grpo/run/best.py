"""The best evaluation so far by ``train.best_metric``: which one improves it, and where its weights are kept
(``<output_dir>/best/``, written by ``grpo.run.checkpoint.save_best`` with ``best.json``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpo.config import ConfigError
from grpo.run.checkpoint import BEST_DIR, BEST_FILE


@dataclass
class BestMetric:
    """The best value of ``metric`` (``mode`` max: higher is better, min: lower) and its step."""

    metric: str
    mode: str = "max"
    value: float | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"best metric mode must be max or min, got {self.mode!r}")

    @classmethod
    def resumed(cls, out: Path, metric: str, mode: str) -> BestMetric:
        """The run folder's best so far (``best/best.json`` of the same metric), else none yet."""
        path = Path(out) / BEST_DIR / BEST_FILE
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("metric") == metric:
                return cls(metric, mode, float(saved["value"]), int(saved["step"]))
        return cls(metric, mode)

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` (an evaluation's logged ones) beat the best so far (the first one always does,
        NaN never). A metric the evaluation does not log is a ConfigError listing the ones it does."""
        if self.metric not in metrics:
            raise ConfigError(f"train.best_metric: the evaluation logs no {self.metric!r}; it logs "
                              f"{', '.join(sorted(metrics))}")
        value = float(metrics[self.metric])
        if math.isnan(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Take ``metrics`` of ``step`` as the best when they improve it; returns whether they did."""
        if not self.improves(metrics):
            return False
        self.value, self.step = float(metrics[self.metric]), step
        return True
