"""Metrics of n sampled completions per problem: mean@n, unbiased pass@k for any k <= n, maj@n (majority vote
over the parsed answers), and bootstrap confidence intervals over problems. Pure functions of the per-sample
scores, so evaluation in training, ``grpo eval`` and tests read the same definitions.

``n`` samples per problem, ``c`` of them correct; a prediction is the parsed answer (None: none parsed).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021) from ``n`` samples of which ``c`` are correct.

    ``1 - C(n - c, k) / C(n, k)``: the chance that k samples drawn without replacement from the n
    contain a correct one. With ``n == k`` it is 1 when ``c > 0`` else 0 (plain any-of-k).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(predictions: Sequence[str | None], same: Callable[[str, str], bool]) -> str | None:
    """The most frequent parsed answer among ``predictions``, answers grouped by ``same`` (e.g. numeric
    equality: "1,080" and "1080.0" are one vote). Unparsed ones (None, blank) never vote. Ties go to the
    answer seen first, so the vote is defined and independent of how a tie would be broken at random;
    None when nothing parsed."""
    groups: list[list] = []  # [representative, votes], in order of first appearance
    for prediction in predictions:
        if prediction is None or not prediction.strip():
            continue
        for group in groups:
            if same(prediction, group[0]) and same(group[0], prediction):
                group[1] += 1
                break
        else:
            groups.append([prediction, 1])
    if not groups:
        return None
    best = max(votes for _, votes in groups)
    return next(answer for answer, votes in groups if votes == best)


def default_ks(n: int) -> list[int]:
    """The k that pass@k is reported for from n samples: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2 ** i for i in range(1, n.bit_length()) if 2 ** i < n)})


def sample_metrics(correct: Sequence[Sequence[bool]], majority_correct: Sequence[bool],
                   ks: Sequence[int] | None = None) -> dict[str, float]:
    """Per-problem means of: ``mean@n`` (the share of a problem's samples that are correct), ``pass@k`` for
    each k (unbiased, ``pass_at_k``), and ``maj@n`` (whether the majority answer is correct).

    Args:
        correct: ``[P][n]`` whether each sample of each problem is correct (the same n for every problem).
        majority_correct: ``[P]`` whether each problem's majority answer (``majority_answer``) is correct.
        ks: the k to report (each 1 <= k <= n); None: ``default_ks(n)``.
    """
    if not correct:
        raise ValueError("sample_metrics: no problems")
    n = len(correct[0])
    if n < 1 or any(len(row) != n for row in correct):
        raise ValueError(f"sample_metrics: every problem needs the same n >= 1 samples, got {sorted({len(r) for r in correct})}")
    if len(majority_correct) != len(correct):
        raise ValueError(f"sample_metrics: {len(majority_correct)} majority votes for {len(correct)} problems")
    ks = default_ks(n) if ks is None else list(ks)
    counts = [sum(map(bool, row)) for row in correct]
    problems = len(correct)
    metrics = {f"mean@{n}": sum(counts) / (problems * n)}
    for k in ks:
        metrics[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / problems
    metrics[f"maj@{n}"] = sum(map(bool, majority_correct)) / problems
    return metrics


def bootstrap_interval(values: Sequence[float], *, draws: int = 1000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the mean of ``values`` (one value per problem, e.g. its pass@k):
    ``draws`` resamples of the problems with replacement, the (1 - level) / 2 and (1 + level) / 2 quantiles
    of their means. Deterministic for a seed."""
    if not values:
        raise ValueError("bootstrap_interval: no values")
    if not 0 < level < 1 or draws < 1:
        raise ValueError(f"bootstrap_interval: level must be in (0, 1) and draws >= 1, got {level}, {draws}")
    rng = random.Random(seed)
    size = len(values)
    means = sorted(sum(values[rng.randrange(size)] for _ in range(size)) / size for _ in range(draws))
    low = means[int(math.floor((1 - level) / 2 * (draws - 1)))]
    high = means[int(math.ceil((1 + level) / 2 * (draws - 1)))]
    return low, high


def sample_std(values: Sequence[float]) -> float:
    """The std with Bessel's correction (``torch.std``'s; TRL's ``nanstd`` of the non-NaN values); NaN below 2."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
