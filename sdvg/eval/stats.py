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
