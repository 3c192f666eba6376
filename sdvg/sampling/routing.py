"""The routing modes, one strategy each (as the cache regimes are one policy each), and what they share: the route
record, a block's frame scores computed on demand, and the score helpers. :class:`router.Router` holds the state
(thresholds, draws, records) and asks the strategy of its mode; nothing else tests a mode by name.

A strategy answers three questions: which block the target makes without a draft (``forced``), whether drafts are
scored (``scores``), and the decision on a draft (``decide``, from its frame scores when it scores them).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol

from ..errors import ConfigError
from ..jsonable import to_jsonable

FORCE_FIRST_REASON = "force-reject block 0: anchors composition"
TARGET_ONLY_REASON = "target-only mode"
AGGREGATIONS = ("min", "mean", "quantile")


class RouterMode(str, Enum):
    REWARD = "reward"  # SDVG: score the draft's frames, accept when the block score reaches the threshold
    RANDOM = "random"  # accept with probability random_rate (seeded)
    DRAFT_ONLY = "draft-only"  # the drafter-only baseline: every block drafted and kept
    TARGET_ONLY = "target-only"  # the baseline: the target makes every block
    PATTERN = "pattern"  # an exact acceptance pattern (benchmarks, matched-acceptance baselines)

    def __str__(self) -> str:
        return self.value


MODES = tuple(m.value for m in RouterMode)


@dataclass
class RouteRecord:
    """One routing decision. ``tau`` is the threshold in force (None when no threshold applied)."""

    block: int
    decision: str  # "accept" | "reject"
    reason: str
    q: float | None = None
    scores: list[float] = field(default_factory=list)
    tau: float | None = None
    aggregation: str | None = None

    @property
    def accepted(self) -> bool:
        return self.decision == "accept"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: non-finite floats become the strings "inf", "-inf" or "nan" (strict JSON has none)."""
        return to_jsonable(asdict(self))


@dataclass
class FrameScores:
    """A drafted block's frame rewards, computed only as far as the router asks: ``score(indices)`` gives those
    frames' rewards (``None``: every frame, one call), ``chunks()`` every frame's, a few frames per call (early exit:
    the router closes the iterator at the first frame below τ)."""

    count: int
    score: Callable[[list[int] | None], Any]
    chunks: Callable[[], Iterable[Any]] | None = None


def to_float_list(scores: Any) -> list[float]:
    """Scores (tensor, numpy array, sequence, scalar) → list of Python floats."""
    if scores is None:
        return []
    if hasattr(scores, "detach"):  # torch tensor
        return [float(s) for s in scores.detach().float().cpu().reshape(-1).tolist()]
    if hasattr(scores, "tolist"):
        out = scores.tolist()
        return [float(s) for s in (out if isinstance(out, list) else [out])]
    if isinstance(scores, (int, float)):
        return [float(scores)]
    return [float(s) for s in scores]


def spread_frames(n: int, k: int) -> list[int]:
    """``k`` frame indices spread evenly over ``0..n-1`` (4 of 12: 0, 4, 7, 11; 1: the middle one)."""
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [n // 2]


def quantile(values: Sequence[float], p: float) -> float:
    """Empirical quantile with linear interpolation between order statistics (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    pos = p * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def aggregate(scores: Sequence[float], how: str, q: float = 0.1) -> float:
    if how == "min":
        return min(scores)
    if how == "mean":
        return math.fsum(scores) / len(scores)
    if how == "quantile":
        return quantile(scores, q)
    raise ConfigError(f"Unknown aggregation {how!r}. Valid: {', '.join(AGGREGATIONS)}.")


def fmt(value: float) -> str:
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return f"{value:.2f}"


class RouterState(Protocol):
    """What a strategy reads and asks of the router (``router.Router``) that holds its state."""

    config: Any  # the RouterConfig
    rng: random.Random
    drafted: int

    def wants_reference_score(self, block: int) -> bool: ...

    def read_scores(self, scores: FrameScores) -> tuple[list[float], str]: ...

    def next_drafted(self) -> int: ...

    def threshold_decision(self, block: int, values: list[float], *, note: str = "") -> RouteRecord: ...


class Routing:
    """A routing mode's rules (the base: block 0 may be forced to the target, drafts are not scored)."""

    unused_model: str | None = None  # the DiT this mode never runs
    drafts = True  # whether any block is drafted
    forces_first = True  # force_reject_first applies
    uses_pattern = False  # the mode reads RouterConfig.pattern

    def forced(self, router: RouterState, block: int) -> str | None:
        return FORCE_FIRST_REASON if block == 0 and router.config.force_reject_first else None

    def scores(self, config: Any) -> bool:
        """Whether every draft is decoded and scored with the reward model."""
        return False

    def uses_reference(self, config: Any) -> bool:
        """Whether the threshold is relative to the target's own score (which the run then measures)."""
        return False

    def exits_early(self, config: Any) -> bool:
        """Whether scoring may stop at the first frame below τ (the decision stays the full one)."""
        return False

    def cascade_allowed(self, config: Any) -> bool:
        return False

    def cascade_stops(self, router: RouterState, values: list[float]) -> bool:
        """Whether a cascade's subset settles the block (a reject), so the rest need not be scored."""
        return any(v < router.config.tau or math.isnan(v) for v in values)

    def on_fault(self, router: RouterState) -> None:
        """A draft that cannot be verified still takes its drafted-block slot (draws and patterns stay aligned)."""

    def decide(self, router: RouterState, block: int, scores: Any) -> RouteRecord:
        raise NotImplementedError

    def values(self, router: RouterState, scores: Any) -> tuple[list[float], str]:
        """The frame scores to record (and decide on) and a note on how they were scored: given values as they are;
        a :class:`FrameScores` only when this mode scores drafts."""
        if not isinstance(scores, FrameScores):
            return to_float_list(scores), ""
        if not self.scores(router.config):
            return [], ""
        return router.read_scores(scores)


class RewardRouting(Routing):
    def forced(self, router: RouterState, block: int) -> str | None:
        reason = super().forced(router, block)
        if reason is None and router.wants_reference_score(block):
            return f"relative threshold: the target's block {block} sets the reference score"
        return reason

    def scores(self, config: Any) -> bool:
        return True

    def uses_reference(self, config: Any) -> bool:
        return config.threshold == "relative"

    def exits_early(self, config: Any) -> bool:
        return config.early_exit and config.aggregation == "min" and config.threshold == "fixed"

    def cascade_allowed(self, config: Any) -> bool:
        return config.aggregation == "min" and config.threshold == "fixed"

    def decide(self, router: RouterState, block: int, scores: Any) -> RouteRecord:
        values, note = self.values(router, scores)
        if not values:
            raise ConfigError(f"Router in reward mode needs the frame scores of block {block}; got none.")
        return router.threshold_decision(block, values, note=note)


class DrawnRouting(Routing):
    """Random and pattern modes: the i-th drafted block's decision is drawn (or read), scores only recorded."""

    def scores(self, config: Any) -> bool:
        return config.score_drafts

    def decide(self, router: RouterState, block: int, scores: Any) -> RouteRecord:
        values, _ = self.values(router, scores)
        c = router.config
        i = router.next_drafted()
        ok, reason = self.draw(router, block, i)
        q = aggregate(values, c.aggregation, c.q) if values else None
        agg = c.aggregation if values else None
        return RouteRecord(block, "accept" if ok else "reject", reason, q=q, scores=values, aggregation=agg)

    def draw(self, router: RouterState, block: int, i: int) -> tuple[bool, str]:
        raise NotImplementedError

    def on_fault(self, router: RouterState) -> None:
        router.next_drafted()


class RandomRouting(DrawnRouting):
    def on_fault(self, router: RouterState) -> None:
        super().on_fault(router)
        router.rng.random()

    def draw(self, router: RouterState, block: int, i: int) -> tuple[bool, str]:
        draw, rate = router.rng.random(), router.config.random_rate
        ok = draw < rate
        return ok, f"random draw {draw:.3f} {'<' if ok else '≥'} rate {rate:.2f}"


class PatternRouting(DrawnRouting):
    uses_pattern = True

    def cascade_allowed(self, config: Any) -> bool:
        return True

    def cascade_stops(self, router: RouterState, values: list[float]) -> bool:
        """The pattern stands in for what the subset finds: a rejected block is scored on the subset only."""
        pattern, i = router.config.pattern, router.drafted
        return not pattern[i] if i < len(pattern) else False

    def draw(self, router: RouterState, block: int, i: int) -> tuple[bool, str]:
        pattern = router.config.pattern
        if i >= len(pattern):
            raise ConfigError(f"Router pattern has {len(pattern)} entries; block {block} is drafted block {i}.")
        return pattern[i], f"pattern entry {i}: {'accept' if pattern[i] else 'reject'}"


class DraftOnlyRouting(Routing):
    unused_model = "target"
    forces_first = False  # the drafter-only baseline generates every block, block 0 included

    def forced(self, router: RouterState, block: int) -> str | None:
        return None

    def decide(self, router: RouterState, block: int, scores: Any) -> RouteRecord:
        return RouteRecord(block, "accept", "draft-only mode", scores=self.values(router, scores)[0])


class TargetOnlyRouting(Routing):
    unused_model = "drafter"
    drafts = False

    def forced(self, router: RouterState, block: int) -> str | None:
        return TARGET_ONLY_REASON


STRATEGIES: dict[RouterMode, Routing] = {
    RouterMode.REWARD: RewardRouting(), RouterMode.RANDOM: RandomRouting(), RouterMode.DRAFT_ONLY: DraftOnlyRouting(),
    RouterMode.TARGET_ONLY: TargetOnlyRouting(), RouterMode.PATTERN: PatternRouting(),
}


def strategy(mode: str | RouterMode) -> Routing:
    try:
        return STRATEGIES[RouterMode(mode)]
    except ValueError as exc:
        raise ConfigError(f"Unknown router mode {mode!r}. Valid: {', '.join(MODES)}.") from exc


def early_exit_scores(chunks: Iterable[Any], tau: float) -> tuple[list[float], str]:
    """Every chunk's scores until one holds a frame below τ (or NaN): then the iterator is closed and the note says
    where scoring stopped."""
    values: list[float] = []
    iterator = iter(chunks)
    for chunk in iterator:
        start = len(values)
        values.extend(to_float_list(chunk))
        bad = next((i for i in range(start, len(values)) if values[i] < tau or math.isnan(values[i])), None)
        if bad is not None:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            return values, f"; early exit at frame {bad}"
    return values, ""
