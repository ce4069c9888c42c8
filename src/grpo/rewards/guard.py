"""``RewardFunction``: a reward callable made safe to call from the training loop.

A reward that raises must not kill a run that has been training for hours, and must not silently
change results either. So:

- the function is called on the whole batch first (fast path, and what batched rewards need);
- if that raises, it is called once per sample, so only the samples that raise get None ("abstain");
  functions marked ``per_sample_fallback = False`` (reward model, remote endpoint: their failures are
  about infrastructure, not samples, and N retries would stall the step) give None to the whole batch;
- the first failure of each function is logged with the sample's prompt and completion excerpts and
  the traceback; later failures are only counted (``num_failures``), so a broken reward cannot flood
  the log;
- a NaN or infinite value becomes None, with one warning per function (``num_nonfinite`` counts them);
- a result of the wrong length, or a value that is not a number or None, is a bug in the reward and
  raises RewardError naming the function: no per-sample fallback could make it right.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from grpo.rewards.base import RewardCallable, RewardError

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 200


def _excerpt(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + f"... [{len(text)} chars]"


def _sample_columns(columns: dict[str, Any], index: int, n: int) -> dict[str, Any]:
    """Columns for sample ``index`` alone: per-sample sequences (length ``n``) are sliced to length 1;
    anything else (e.g. TRL's ``trainer_state``) is passed through unchanged."""
    sliced = {}
    for key, value in columns.items():
        is_per_sample = (
            hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)) and len(value) == n
        )
        sliced[key] = value[index : index + 1] if is_per_sample else value
    return sliced


class RewardFunction:
    """Wraps a TRL-signature reward ``fn`` (see ``base.py``); calling it has the same signature.

    Attributes:
        fn: the wrapped callable.
        name / __name__: the name used in logs (``reward/<name>``); defaults to ``fn.__name__``.
        per_sample_fallback: retry sample by sample after a whole-batch failure; defaults to
            ``fn.per_sample_fallback`` when the function sets it, else True.
        num_failures: samples whose reward raised so far (each got None).
        num_nonfinite: NaN / inf values turned into None so far.
    """

    def __init__(
        self, fn: RewardCallable, name: str | None = None, per_sample_fallback: bool | None = None
    ) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.__name__ = self.name  # TRL and our logger both read __name__
        if per_sample_fallback is None:
            per_sample_fallback = bool(getattr(fn, "per_sample_fallback", True))
        self.per_sample_fallback = per_sample_fallback
        self.num_failures = 0
        self.num_nonfinite = 0

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}, fn={self.fn!r})"

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        """Rewards for N samples: list of length N, None where the function abstained or failed."""
        n = len(completions)
        try:
            raw = self.fn(prompts, completions, **columns)
        except Exception as error:  # any failure of user code; the per-sample pass reports it
            if not self.per_sample_fallback:
                self._record_failure(error, prompts[0] if n else None, completions[0] if n else None, count=n)
                return [None] * n
            logger.debug("reward %r failed on a batch of %d; retrying per sample", self.name, n, exc_info=True)
            return self._call_per_sample(prompts, completions, columns)
        return self._check(raw, n)

    def _call_per_sample(
        self, prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Any]
    ) -> list[float | None]:
        n = len(completions)
        rewards: list[float | None] = []
        for i in range(n):
            try:
                raw = self.fn(prompts[i : i + 1], completions[i : i + 1], **_sample_columns(columns, i, n))
            except Exception as error:  # only this sample abstains; see module docstring
                self._record_failure(error, prompts[i], completions[i], count=1)
                rewards.append(None)
                continue
            rewards.extend(self._check(raw, 1))
        return rewards

    def _record_failure(self, error: Exception, prompt: Any, completion: Any, count: int) -> None:
        if self.num_failures == 0:
            logger.error(
                "reward %r raised %s on %s; its reward is None there. Later failures of this reward "
                "are counted (num_failures), not logged.\n  prompt: %s\n  completion: %s",
                self.name,
                type(error).__name__,
                "a sample" if count == 1 else f"a whole batch of {count} (no per-sample retry)",
                _excerpt(prompt),
                _excerpt(completion),
                exc_info=(type(error), error, error.__traceback__),
            )
        self.num_failures += count

    def _check(self, raw: Any, n: int) -> list[float | None]:
        """Validate a returned batch: length n, each value a real number or None; NaN/inf -> None."""
        try:
            length = len(raw)
        except TypeError:
            raise RewardError(
                f"reward {self.name!r} returned {type(raw).__name__}, expected a list of {n} floats or None"
            ) from None
        if length != n:
            raise RewardError(f"reward {self.name!r} returned {length} values for {n} completions")
        rewards: list[float | None] = []
        for i, value in enumerate(raw):
            if value is None:
                rewards.append(None)
                continue
            if isinstance(value, (str, bytes)):
                raise RewardError(f"reward {self.name!r} returned {value!r} at index {i}; expected a float or None")
            try:
                reward = float(value)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {self.name!r} returned {value!r} at index {i}; expected a float or None"
                ) from None
            if not math.isfinite(reward):
                if self.num_nonfinite == 0:
                    logger.warning(
                        "reward %r returned %r at index %d; non-finite rewards become None (abstain). "
                        "Later ones are counted (num_nonfinite), not logged.",
                        self.name,
                        reward,
                        i,
                    )
                self.num_nonfinite += 1
                rewards.append(None)
                continue
            rewards.append(reward)
        return rewards
