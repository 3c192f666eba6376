"""Bootstrap confidence intervals over prompts (seeded, so a rerun prints the same interval)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def bootstrap_ci(items: Sequence, statistic: Callable[[Sequence], float | None], *, resamples: int = BOOTSTRAP_RESAMPLES,
                 level: float = CONFIDENCE, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``statistic`` over ``items`` (e.g. one per prompt): the items are resampled
    with replacement ``resamples`` times by ``random.Random(seed)``. None for no items or no finite statistic."""
    if not items:
        return None
    rng = random.Random(seed)
    n = len(items)
    values = []
    for _ in range(resamples):
        v = statistic([items[rng.randrange(n)] for _ in range(n)])
        if v is not None:
            values.append(v)
    if not values:
        return None
    values.sort()
    alpha = (1.0 - level) / 2.0
    lo = values[min(len(values) - 1, max(0, int(alpha * len(values))))]
    hi = values[min(len(values) - 1, max(0, int((1.0 - alpha) * len(values)) - 1))]
    return lo, hi


def mean_ci(values: Sequence[float], *, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` (one per prompt or pair, at least one) and its bootstrap interval."""
    if not values:
        raise ValueError("mean_ci needs at least one value")
    values = list(values)
    lo, hi = bootstrap_ci(values, lambda xs: sum(xs) / len(xs), seed=seed)
    return sum(values) / len(values), lo, hi


def mean_or_none(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on average ranks, so ties count); None when either side is constant
    or there are fewer than two pairs."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs pairs: {len(xs)} x values, {len(ys)} y values")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None
