"""``RewardFunction``: a reward callable called the way TRL calls it, made safe for the training loop.

TRL 1.16 calls every reward by keyword only (``context.py``):

    fn(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=...,
       log_metric=...)

so a function may take any subset of those by name and must accept the rest with ``**kwargs``.
``column_map`` lets one reward read a dataset column under another name (TRL's ``accuracy_reward``
reads ``solution``; GSM8K records carry ``answer``).

A reward that raises on some samples must not kill a run that has been training for hours, and one
that never works must not let the run train on nothing. So:

- the function is called on the whole batch first (fast path, and what batched rewards need);
- if that raises, it is called once per sample, so only the samples that raise get None ("abstain");
  functions marked ``per_sample_fallback = False`` (reward model, remote endpoint: their failures are
  about infrastructure, not samples, and N retries would stall the step) are not retried;
- a failure on *every* sample of a call is a configuration error, not a flaky sample: ``RewardError``
  (exit 2) naming the reward, its error and one sample, before any update uses the batch. For an
  infrastructure reward that has already worked in this run, a failed batch abstains instead (an
  endpoint's outage after hours of training is not a configuration error; it is logged and counted);
- the first failure of each function is logged with the sample's prompt and completion excerpts and
  the traceback; later failures are only counted (``num_failures``), so a broken reward cannot flood
  the log;
- a NaN or infinite value becomes None, with one warning per function (``num_nonfinite`` counts them);
- a result of the wrong length, or a value that is not a number or None, is a bug in the reward and
  raises RewardError naming the function: no per-sample fallback could make it right;
- async functions are awaited (``score`` gathers them, as TRL does); the rules above hold for them too.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from grpo.rewards.async_loop import is_async_callable, run_coroutine
from grpo.rewards.context import RewardContext
from grpo.rewards.signature import RewardCallable, RewardError

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 200
SIGNATURE_HINT = ("rewards are called as TRL calls them, by keyword: fn(prompts=..., completions=..., "
                  "completion_ids=..., <dataset columns>..., trainer_state=..., log_extra=..., log_metric=...); "
                  "name the arguments you use and accept the rest with **kwargs")


def _excerpt(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + f"... [{len(text)} chars]"


class _Call:
    """The keyword arguments of one call: the batch (sliceable per sample) and the context."""

    def __init__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] | None,
                 columns: Mapping[str, Sequence[Any]], context: RewardContext) -> None:
        self.prompts, self.completions, self.columns, self.context = prompts, completions, columns, context
        self.completion_ids = completion_ids if completion_ids is not None else [None] * len(completions)

    def keywords(self, index: int | None = None) -> dict[str, Any]:
        """All rows (``index`` None) or row ``index`` alone, as lists of length N or 1."""
        rows = slice(None) if index is None else slice(index, index + 1)
        return {"prompts": list(self.prompts[rows]), "completions": list(self.completions[rows]),
                "completion_ids": list(self.completion_ids[rows]),
                **{key: list(values[rows]) for key, values in self.columns.items()},
                **self.context.keywords()}


class RewardFunction:
    """Wraps a TRL-signature reward ``fn`` (see the module docstring).

    Attributes:
        fn: the wrapped callable.
        name / __name__: the name used in logs (``reward/<name>``); defaults to ``fn.__name__``.
        per_sample_fallback: retry sample by sample after a whole-batch failure; defaults to
            ``fn.per_sample_fallback`` when the function sets it, else True.
        column_map: keyword the reward reads -> dataset column it is read from.
        is_async: ``fn`` returns a coroutine.
        num_failures: samples whose reward raised so far (each got None).
        num_nonfinite: NaN / inf values turned into None so far.
        num_calls_ok: calls in which at least one sample was scored.
    """

    def __init__(self, fn: RewardCallable, name: str | None = None, per_sample_fallback: bool | None = None,
                 column_map: Mapping[str, str] | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.__name__ = self.name  # TRL and our logger both read __name__
        if per_sample_fallback is None:
            per_sample_fallback = bool(getattr(fn, "per_sample_fallback", True))
        self.per_sample_fallback = per_sample_fallback
        self.column_map = dict(column_map or {})
        self.is_async = is_async_callable(fn)
        self.num_failures = 0
        self.num_nonfinite = 0
        self.num_calls_ok = 0

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}, fn={self.fn!r})"

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any] | None = None,
                 context: RewardContext | None = None, **columns: Sequence[Any]) -> list[float | None]:
        """Rewards for N samples: a list of N, None where the function abstained or a sample failed.
        ``columns`` are the dataset columns, each a list of N; ``context`` defaults to a fresh one."""
        if self.is_async:
            return run_coroutine(self.acall(prompts, completions, completion_ids, context, **columns))
        call = self._call(prompts, completions, completion_ids, context, columns)
        try:
            raw = self.fn(**call.keywords())
        except Exception as error:  # any failure of user code; decided in _batch_failed
            if not self.per_sample_fallback:
                return self._batch_failed(error, call)
            logger.debug("reward %r failed on a batch of %d; retrying per sample", self.name, len(completions),
                         exc_info=True)
            outcomes: list[Any] = []
            for i in range(len(completions)):
                try:
                    outcomes.append(self.fn(**call.keywords(i)))
                except Exception as sample_error:  # only this sample abstains; see module docstring
                    outcomes.append(sample_error)
            return self._per_sample(outcomes, call)
        return self._succeeded(self._check(raw, len(completions)), call)

    async def acall(self, prompts: Sequence[Any], completions: Sequence[Any],
                    completion_ids: Sequence[Any] | None = None, context: RewardContext | None = None,
                    **columns: Sequence[Any]) -> list[float | None]:
        """``__call__`` for an async ``fn``, to be awaited (per-sample retries run concurrently)."""
        call = self._call(prompts, completions, completion_ids, context, columns)
        try:
            raw = await self.fn(**call.keywords())
        except Exception as error:  # see __call__
            if not self.per_sample_fallback:
                return self._batch_failed(error, call)
            outcomes = await asyncio.gather(*(self.fn(**call.keywords(i)) for i in range(len(completions))),
                                            return_exceptions=True)
            return self._per_sample(list(outcomes), call)
        return self._succeeded(self._check(raw, len(completions)), call)

    # ------------------------------------------------------------------ helpers

    def _call(self, prompts, completions, completion_ids, context, columns) -> _Call:
        mapped = dict(columns)
        for keyword, column in self.column_map.items():
            if column not in columns:
                raise RewardError(f"reward {self.name!r}: columns maps {keyword!r} to the dataset column "
                                  f"{column!r}, which the data does not have; columns: {sorted(columns)}")
            mapped[keyword] = columns[column]
        return _Call(prompts, completions, completion_ids, mapped, context or RewardContext())

    def _per_sample(self, outcomes: list[Any], call: _Call) -> list[float | None]:
        rewards: list[float | None] = []
        errors = []
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):  # KeyboardInterrupt, SystemExit: never swallowed
                    raise outcome
                errors.append((i, outcome))
                self._record_failure(outcome, call.prompts[i], call.completions[i], count=1)
                rewards.append(None)
            else:
                rewards.extend(self._check(outcome, 1))
        if outcomes and len(errors) == len(outcomes):
            index, error = errors[0]
            raise self._config_error(error, call, index)
        return self._succeeded(rewards, call)

    def _batch_failed(self, error: Exception, call: _Call) -> list[float | None]:
        """A whole-batch failure of an infrastructure reward (no per-sample retry)."""
        n = len(call.completions)
        if self.num_calls_ok == 0:
            raise self._config_error(error, call, 0)
        self._record_failure(error, call.prompts[0] if n else None, call.completions[0] if n else None, count=n)
        return [None] * n

    def _succeeded(self, rewards: list[float | None], call: _Call) -> list[float | None]:
        self.num_calls_ok += 1
        if rewards and all(r is None for r in rewards):
            logger.warning("reward %r abstained (None) on all %d samples of this step (it raised nothing): its "
                           "column is empty; sample completion: %s", self.name, len(rewards),
                           _excerpt(call.completions[0]))
        return rewards

    def _config_error(self, error: Exception, call: _Call, index: int) -> RewardError:
        hint = f"\n  ({SIGNATURE_HINT})" if isinstance(error, TypeError) else ""
        return RewardError(
            f"reward {self.name!r} failed on every one of the {len(call.completions)} samples of this step, so "
            f"it is not a flaky sample but a broken reward or configuration: {type(error).__name__}: {error}"
            f"{hint}\n  sample prompt: {_excerpt(call.prompts[index])}\n  sample completion: "
            f"{_excerpt(call.completions[index])}")

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
