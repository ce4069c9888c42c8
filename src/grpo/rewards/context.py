"""What TRL 1.16 passes to every reward function beside the batch, and what comes back through it.

``GRPOTrainer._calculate_rewards`` calls each reward as

    fn(prompts=..., completions=..., completion_ids=..., **columns,
       trainer_state=..., log_extra=..., log_metric=...)

``RewardContext`` holds the last three for one scoring call:

- ``trainer_state``: a ``transformers.TrainerState`` (TRL passes its trainer's own), so curriculum
  rewards that read ``trainer_state.global_step / trainer_state.max_steps`` work unchanged.
  ``global_step`` is the number of training steps finished before this batch was sampled (0 for the
  first), as in TRL, where it counts the optimizer steps taken so far.
- ``log_metric(name, value)``: a scalar for this step; the values logged under one name are averaged
  and land in ``metrics.jsonl`` under that name (TRL averages them per logging step too).
- ``log_extra(column, values)``: one value per completion, extra columns for the completions table;
  here they land in ``samples.jsonl`` under ``extras``. TRL extends a list per call, so a reward that
  is retried sample by sample (see ``reward_function.py``) still adds up to one value per completion.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers' import costs seconds to every `import grpo.config`, the decoupled launcher's too
    from transformers.trainer_callback import TrainerState

logger = logging.getLogger(__name__)

# The keyword arguments that are not dataset columns (never per-sample lists, never sent to a remote reward).
CONTEXT_KEYS = ("trainer_state", "log_extra", "log_metric")


def make_trainer_state(global_step: int, max_steps: int, epoch: float | None = None) -> TrainerState:
    """The ``trainer_state`` a reward sees: steps finished so far, the run's total, the epoch."""
    from transformers.trainer_callback import TrainerState  # on first use: not in `import grpo.config` (seconds)

    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=epoch)


class RewardContext:
    """``trainer_state`` plus the two logging hooks for one scoring call; collects what was logged.

    Attributes:
        trainer_state: see the module docstring.
        metrics: name -> values given to ``log_metric`` during this call.
        extras: column -> values given to ``log_extra`` during this call (extended, as TRL does).
    """

    def __init__(self, trainer_state: TrainerState | None = None) -> None:
        self.trainer_state = trainer_state if trainer_state is not None else make_trainer_state(0, 0)
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extras: dict[str, list[Any]] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        """A reward's scalar for this step (TRL's ``log_metric``); must be a finite number."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric: the name must be a non-empty string, got {name!r}")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be finite")
        self.metrics[name].append(number)

    def log_extra(self, column: str, values: list) -> None:
        """Extra per-completion values for the samples (TRL's ``log_extra``)."""
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra: the column must be a non-empty string, got {column!r}")
        self.extras[column].extend(values)

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments TRL adds to every reward call."""
        return {"trainer_state": self.trainer_state, "log_extra": self.log_extra, "log_metric": self.log_metric}

    def metric_means(self) -> dict[str, float]:
        """name -> mean of the values logged under it during this call."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}

    def extra_columns(self, n: int) -> dict[str, list]:
        """The ``log_extra`` columns that hold exactly one value per completion; any other column is
        left out with a warning saying why (it cannot be matched to the samples)."""
        columns = {}
        for column, values in self.extras.items():
            if len(values) == n:
                columns[column] = [v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
                                   for v in values]  # samples.jsonl is JSON: other objects as their str()
            else:
                logger.warning("log_extra column %r got %d values for %d completions this step (two rewards "
                               "logging the same column, or samples that failed); it is not written to "
                               "samples.jsonl for this step", column, len(values), n)
        return columns
