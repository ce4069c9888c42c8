"""User reward functions that misbehave, loaded by dotted path as a user's would be."""

import math


def _texts(completions):
    return [c[0]["content"] if isinstance(c, list) else c for c in completions]


def raises_on_odd_length(prompts, completions, **kwargs):
    """1.0 for a completion of even length; raises for an odd one (a flaky reward: some samples fail)."""
    texts = _texts(completions)
    if any(len(t) % 2 for t in texts):
        raise ValueError("this reward cannot score odd-length completions")
    return [1.0] * len(texts)


def one_too_many(prompts, completions, **kwargs):
    """A bug: one value more than there are completions."""
    return [0.0] * (len(completions) + 1)


def nan_for_all(prompts, completions, **kwargs):
    """NaN for every completion (e.g. a judge that divided by zero)."""
    return [math.nan] * len(completions)


def positional_only(prompts, completions):
    """Written for a positional call: cannot take TRL's keyword call (completion_ids, trainer_state, ...)."""
    return [0.0] * len(completions)


def raises_always(prompts, completions, **kwargs):
    """Fails on every sample (e.g. a typo in the column it reads): a configuration error, not a flaky sample."""
    return [float(kwargs["gold"][i]) for i in range(len(completions))]


def fails_on_rank_1(prompts, completions, **kwargs):
    """Fails on every sample, but only on rank 1 (a file only one node has, a GPU fault): the other ranks wait in
    the step's collectives, and must learn of the failure rather than wait for the collective timeout."""
    import os

    if os.environ.get("RANK") == "1":
        raise KeyError("gold")
    return [0.0] * len(completions)


def letters_slowly(prompts, completions, **kwargs):
    """The share of letters, after GRPO_TEST_REWARD_SLEEP_S seconds (0 unless set): a sampler that is slow to
    score, set per process so that two samplers of one recipe differ only in their pace."""
    import os
    import time

    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP_S", "0")))
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in _texts(completions)]
