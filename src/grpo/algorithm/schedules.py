"""Learning-rate decay after warm-up, by name (``optim.lr_scheduler_type``, ``critic.lr_scheduler_type``): each
maps the decay's progress (0 at the end of warm-up, 1 at the last update) to the factor on the peak rate."""

from __future__ import annotations

import math
from typing import Callable


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return max(0.0, 1.0 - progress)


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}
