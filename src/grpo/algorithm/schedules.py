"""Learning-rate decay after warm-up, by name (``optim.lr_scheduler_type``, ``critic.lr_scheduler_type``): each
maps the decay's progress (0 at the end of warm-up, 1 at the last update) and its arguments
(``optim.lr_scheduler_kwargs``: transformers' ``lr_scheduler_kwargs``, under transformers' names) to the factor on
the peak rate, as transformers' schedules of the same name compute it after their warm-up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return max(0.0, 1.0 - progress)


def _cosine(progress: float, num_cycles: float = 0.5) -> float:
    # num_cycles 0.5: one half-wave from 1 down to 0 at the last update (transformers' default)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _cosine_with_min_lr(progress: float, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    # the cosine's factor squeezed into [min_lr_rate, 1]
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


@dataclass(frozen=True)
class Decay:
    """A decay's factor ``fn(progress, **arguments)`` and the ``lr_scheduler_kwargs`` names it takes (``min_lr``
    is an absolute rate, turned into ``min_lr_rate`` by ``decay_arguments``); ``needs_one_of``: names of which
    exactly one must be given (transformers raises without them)."""

    fn: Callable[..., float]
    takes: tuple[str, ...] = ()
    needs_one_of: tuple[str, ...] = ()


LR_SCHEDULES: dict[str, Decay] = {
    "constant": Decay(_constant),
    "linear": Decay(_linear),
    "cosine": Decay(_cosine, ("num_cycles",)),
    "cosine_with_min_lr": Decay(_cosine_with_min_lr, ("num_cycles", "min_lr", "min_lr_rate"),
                                needs_one_of=("min_lr", "min_lr_rate")),
}


def decay_arguments(kind: str, kwargs: dict[str, Any], peak_lr: float, key: str) -> dict[str, float]:
    """``kwargs`` (``key``'s value) as the keyword arguments of ``LR_SCHEDULES[kind].fn``, checked: a name the decay
    does not take, a value that is not a number, or not exactly one of ``needs_one_of`` is a ValueError naming
    ``key``. ``min_lr`` becomes ``min_lr / peak_lr`` (transformers divides by the optimizer's rate)."""
    decay = LR_SCHEDULES[kind]
    unknown = sorted(set(kwargs) - set(decay.takes))
    if unknown:
        takes = ", ".join(decay.takes) or "no arguments"
        raise ValueError(f"{key}: {unknown} are not arguments of the {kind} schedule, which takes {takes}")
    arguments = {name: _number(value, f"{key}: {name}") for name, value in kwargs.items()}
    given = [name for name in decay.needs_one_of if name in kwargs]
    if decay.needs_one_of and len(given) != 1:
        raise ValueError(f"{key}: the {kind} schedule needs exactly one of {' or '.join(decay.needs_one_of)} "
                         f"(transformers' rule), got {given or 'none'}")
    if "min_lr" in arguments:
        arguments["min_lr_rate"] = arguments.pop("min_lr") / peak_lr
    return arguments


def _number(value: Any, name: str) -> float:
    # PyYAML reads 1e-6 (no dot) as text: such text is the number it spells, as the config loader takes floats
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{name} must be a number, got {value!r}")
