"""The bench's cost model: measured per-call costs, the analytic call counts of a run, speedup estimators.

- :class:`CostModel`: the median seconds of each call (kind + signature), pooled over runs; ``predict`` prices a
  sequence of calls with no overhead and no overlap (the bound's numerator and denominator).
- :func:`pattern_counts`: the calls a (non-pipelined) run needs for an acceptance pattern, from the cache policy's
  rules, the analytic twin of the traced counts.
- :func:`paired_speedup`, :func:`segment_min_wall`: speedup and wall estimators robust to a shared machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..sampling.calls import CALL_KINDS
from ..sampling.regimes import CacheConfig, CachePolicy
from .tracing import RunMeasure


@dataclass
class CostModel:
    """Median seconds of one call, keyed by (kind, signature) and pooled over runs; per-kind medians as a fallback.

    The signature is what a call's cost depends on besides the model (a DiT forward: frame offset, frames, cache
    write; a decode: first block or not, latent frames; a score: frames), so a row whose calls sit at other
    positions than the baseline's (only block 0's short-context target forwards at 100 % acceptance) is priced
    with the right calls. Medians, not means: a call that meets a burst of the shared machine does not move them.
    """

    by_call: dict[tuple[str, tuple], float]
    by_kind: dict[str, float | None]
    calls_seen: dict[tuple[str, tuple], int] = field(default_factory=dict)

    @classmethod
    def from_runs(cls, runs: Sequence[RunMeasure]) -> CostModel:
        per_call: dict[tuple[str, tuple], list[float]] = {}
        per_kind: dict[str, list[float]] = {k: [] for k in CALL_KINDS}
        for r in runs:
            for kind, sig, seconds in r.calls:
                per_call.setdefault((kind, sig), []).append(seconds)
                per_kind.setdefault(kind, []).append(seconds)
        return cls(by_call={k: statistics.median(v) for k, v in per_call.items()},
                   by_kind={k: (statistics.median(v) if v else None) for k, v in per_kind.items()},
                   calls_seen={k: len(v) for k, v in per_call.items()})

    def cost(self, kind: str, signature: tuple = ()) -> float:
        c = self.by_call.get((kind, signature))
        if c is None:
            c = self.by_kind.get(kind)
        if c is None:
            raise ConfigError(f"No measured cost for call kind {kind!r}.")
        return c

    def predict(self, calls: Sequence[tuple]) -> float:
        """Seconds a sequence of calls ``(kind, signature, …)`` costs: Σ of the medians (no overhead, no overlap)."""
        return sum(self.cost(c[0], c[1]) for c in calls)

    def with_fallback(self, other: CostModel) -> CostModel:
        """This table, with the calls and kinds it never saw priced from ``other``."""
        return CostModel(by_call={**other.by_call, **self.by_call},
                         by_kind={k: v if v is not None else other.by_kind.get(k) for k, v in self.by_kind.items()},
                         calls_seen=dict(self.calls_seen))

    def as_json(self) -> list[dict]:
        """The calls this table measured itself (not the ones it prices from a fallback)."""
        return [{"kind": k, "signature": list(sig), "seconds": self.by_call[(k, sig)], "calls": n}
                for (k, sig), n in sorted(self.calls_seen.items())]


def paired_speedup(base_segments: Sequence[Sequence[float]], row_segments: Sequence[Sequence[float]]) -> float:
    """Speedup of a row over the target-only runs interleaved beside it, one pair of runs per pass.

    For each block segment i: r_i = median over passes of row_i / base_i (the two ran within a round of each other,
    so a burst of the machine lands on both), and B_i = median over passes of base_i. The row's wall in baseline
    terms is Σ r_i·B_i, and the speedup Σ B_i / Σ r_i·B_i. Medians: unbiased for the multiplicative slowdowns of
    a shared machine, where a minimum favours short segments (they are more often caught undisturbed).
    """
    n = len(base_segments[0])
    if len(base_segments) != len(row_segments) or any(len(x) != n for x in (*base_segments, *row_segments)):
        raise ConfigError("Paired runs must have the same passes and block segments.")
    b = [statistics.median(base[i] for base in base_segments) for i in range(n)]
    r = [statistics.median(row[i] / base[i] for base, row in zip(base_segments, row_segments, strict=True))
         for i in range(n)]
    return sum(b) / sum(ri * bi for ri, bi in zip(r, b, strict=True))


def segment_min_wall(runs: Sequence[RunMeasure]) -> float:
    """The row's wall time with the shared machine's bursts taken out: Σ over block segments of the fastest pass.

    A segment's work is the same in every pass (same calls, checked: ``consistent_across_repeats``); interference
    only ever adds time, in bursts of about a second, so the fastest pass of each short segment is its undisturbed
    time far more often than one whole run is undisturbed. Falls back to the fastest whole run when the segment
    lists differ (they never do for a finished run).
    """
    n = len(runs[0].segments)
    if n == 0 or any(len(r.segments) != n for r in runs):
        return min(r.wall for r in runs)
    return sum(min(r.segments[i] for r in runs) for i in range(n))


def pattern_counts(accept: Sequence[bool], *, steps: Sequence[int], policy: CachePolicy | None = None,
                   scored: bool = True, refine_from_step: int | None = None, cascade: bool = False) -> dict[str, int]:
    """Calls a plain (non-pipelined) run needs for an acceptance pattern over drafted blocks 1..N-1 (block 0 is the
    target's), from the cache policy's rules (default: recompute with Krea's first frame).

    A denoise of block b costs its steps, the policy's refill, and one write for every committed earlier block the
    model's cache does not hold (policies that write history: global and noisy; a model holds the blocks it made
    itself only where the last denoising call's K/V are final, noisy). A rejected block is decoded twice (the draft,
    then the target's block); refine-on-reject from step k runs the target's steps k..n-1 only; the context
    re-encodes are one per block, shared by both models. With ``cascade`` an accepted draft is scored in two calls
    (the subset, then the rest) and a rejected one in one (the subset: the pattern stands in for what it finds).
    """
    policy = policy or CacheConfig().policy()
    n = len(steps)
    if len(accept) != n - 1:
        raise ConfigError(f"The pattern has {len(accept)} entries for {n - 1} drafted blocks.")
    counts = {"target": 0, "drafter": 0, "decode": 0, "score": 0, "encode": 0}
    holds: dict[str, set[int]] = {"target": set(), "drafter": set()}

    def denoise(model: str, block: int, num_steps: int) -> None:
        missing = [i for i in range(block) if i not in holds[model]] if policy.writes_history else []
        counts[model] += num_steps + policy.refill_forwards(block) + len(missing)
        holds[model].update(missing)

    def commit(model: str, block: int) -> None:
        if policy.keeps_denoised_block:
            holds[model].add(block)

    denoise("target", 0, steps[0])
    commit("target", 0)
    counts["decode"] += 1
    for b in range(1, n):
        counts["encode"] += policy.context_encodes(b)
        denoise("drafter", b, steps[b])
        counts["decode"] += 1
        counts["score"] += (2 if cascade and accept[b - 1] else 1) if scored else 0
        if accept[b - 1]:
            commit("drafter", b)
            continue
        k = refine_from_step if refine_from_step is not None and refine_from_step < steps[b] else 0
        denoise("target", b, steps[b] - k)
        commit("target", b)
        counts["decode"] += 1
    return counts


def kv_bytes_for(model, regime: str, num_frames: int, latent_hw: tuple[int, int], window: int, sinks: int) -> int:
    """Self-attention KV-cache bytes the sampler allocates for ``model`` (the policy's layout)."""
    from ..sampling.footprint import kv_cache_bytes

    return kv_cache_bytes(model, CacheConfig(regime=regime, window_frames=window, sink_frames=sinks), num_frames,
                          latent_hw)
