"""``python -m sdvg bench``: one-process speed benchmark of the speculative sampler, with a cost-model bound.

Every row ("variant") is run ``warmup`` times on its own, untimed (this also gives its peak memory), then
``repeats`` timed passes run every row once each, in a seeded random order per pass. With ``interleave = k`` (tiny
profile: 2) a pass runs its rows in groups of k beside their own target-only run, one block of each in turn
(:class:`LiveRun`, :func:`run_interleaved`), so that a row and its baseline feel the same state of a shared
machine; see :func:`run_bench`.

What is measured (per timed run)
- The run: ``SpeculativeSampler.run`` from call to return (prompt embeddings are precomputed; the sampler's
  per-video setup, cross-attention K/V and cache allocation, is inside), cut into **block segments** at the moments
  the finished blocks come out (the first segment holds the setup; a last one the tail).
- Every model call is traced by wrapping the instances' methods (no engine change): ``forward_block`` of the
  target and the drafter, ``prepare_cross_attention`` ("setup"), ``StreamingVAE.decode_block`` ("decode"),
  ``encode_frame`` ("encode") and ``ImageReward.score`` ("score"), each with a *signature* (what its cost depends
  on: a forward's frame offset, frame count and cache write; first decode or not; frames scored). On CUDA each
  traced call synchronizes before and after, so its duration is its device time.
- ``overhead`` = 1 − |union of traced call intervals| / wall: the share of wall time spent outside model, VAE and
  reward calls (Python, routing, noise sampling, re-noising, frame copies, thread hand-offs). The union (not the
  sum) keeps it right when pipelined verification overlaps calls on two threads.

Wall time of a row
- ``wall_s`` = Σ over block segments of the fastest pass (:func:`segment_min_wall`). A segment's work is the same in
  every pass; the shared machine's interference only adds time, in bursts of about a second. Also reported: the
  median and the fastest whole-run walls, and every pass's wall and segments.

Cost model and bound
- A per-call cost table is measured in the same bench run (:class:`CostModel`): the median duration of each call
  (kind + signature), pooled over all timed runs that use the same cache regime.
- ``predicted(row)`` = Σ of those costs over the calls the row made (the trace; deterministic for a pattern).
- ``bound = predicted(target-only baseline) / predicted(row)``: the speedup over target-only that the row would
  reach with zero overhead and no overlap.
- ``speedup``: interleaved, :func:`paired_speedup` of the row against the target-only runs beside it (block
  segment by block segment, medians over passes); otherwise ``wall(baseline) / wall(row)``.
  ``efficiency = speedup / bound``. Pipelined rows overlap decode+score with drafting, so they may exceed 1.

Acceptance is forced, so it does not depend on random weights: ``random`` rows use the random router with a router
seed chosen so that the realized acceptance equals the level exactly (the draws are simulated with the same
``random.Random(seed)`` sequence the router uses; the realized pattern is checked after each run). ``scored`` rows
run the real SDVG path (reward mode, fixed τ = 0, min aggregation: snapshot, decode, ImageReward on every frame)
and replace the returned scores by +1 / −1 following the same pattern, so the cost of scoring is paid as in a real
run while the decision is forced.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .devices import set_cpu_threads
from .errors import ConfigError
from .fixtures.random_models import RealSizeSpec, build_real_size_models

logger = logging.getLogger(__name__)

LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
CALL_KINDS = ("target", "drafter", "decode", "score", "encode", "setup")
PHASES = ("draft", "decode", "score", "target", "cache", "output", "verify_wait")
BENCH_PROMPT = "a red fox running through fresh snow at sunrise, cinematic"
SCHEMA = "sdvg-bench/1"
GOAL_EFFICIENCY = 0.95
GOAL_OVERHEAD = 0.03
GOAL_FLAT_GROWTH = 0.10  # per-block time of the last third within 10 % of the first third (blocks ≥ 1)


# ----------------------------------------------------------------------------------------------------------
# variants


@dataclass(frozen=True)
class Variant:
    """One benchmark row. ``router``: target-only | draft-only | random | scored."""

    name: str
    router: str
    level: float | None = None
    regime: str = "recompute"
    schedule: str = "constant"
    pipelined: bool = False
    refine_from_step: int | None = None
    group: str = "sweep"

    @property
    def baseline_key(self) -> str:
        return f"{self.regime}/{self.schedule}"


def default_variants(profile: str = "tiny", levels: Sequence[float] = LEVELS) -> list[Variant]:
    """The default rows. ``tiny``: everything; ``real-size``: the scored (real-cost) rows only."""
    pct = {lv: f"{round(lv * 100)}%" for lv in levels}
    rows = [
        Variant("target-only", "target-only", group="baseline"),
        Variant("draft-only", "draft-only", group="baseline"),
    ]
    if profile == "tiny":
        rows += [Variant(f"random @{pct[lv]}", "random", lv, group="random") for lv in levels]
    rows += [Variant(f"scored @{pct[lv]}", "scored", lv, group="scored") for lv in levels]
    piped = levels if profile == "tiny" else [lv for lv in levels if lv >= 0.75]
    rows += [Variant(f"pipelined @{pct[lv]}", "scored", lv, pipelined=True, group="pipelined") for lv in piped]
    mid = 0.5 if 0.5 in levels else levels[len(levels) // 2]
    hi = 0.75 if 0.75 in levels else levels[-1]
    rows += [
        Variant(f"refine@2 @{pct.get(mid, mid)}", "scored", mid, refine_from_step=2, group="refine"),
        Variant("target-only noisy", "target-only", regime="noisy", group="noisy"),
        Variant(f"scored noisy @{pct.get(hi, hi)}", "scored", hi, regime="noisy", group="noisy"),
        Variant("target-only diagonal", "target-only", regime="noisy", schedule="diagonal", group="diagonal"),
        Variant(f"scored diagonal @{pct.get(hi, hi)}", "scored", hi, regime="noisy", schedule="diagonal",
                group="diagonal"),
    ]
    if profile == "tiny":
        rows.append(Variant("target-only global", "target-only", regime="global", group="global"))
    return rows


def exact_pattern_seed(n_drafted: int, level: float, *, limit: int = 1_000_000) -> tuple[int, list[bool]]:
    """A router seed whose random draws accept exactly ``round(level × n_drafted)`` of the drafted blocks.

    The random router accepts drafted block i (in block order) iff the i-th ``random.Random(seed).random()`` draw
    is below ``random_rate``; with ``random_rate = level`` we search seeds 0, 1, … for the wanted count.
    """
    if not 0.0 <= level <= 1.0:
        raise ConfigError(f"Acceptance level {level} is outside [0, 1].")
    want = round(level * n_drafted)
    for seed in range(limit):
        rng = random.Random(seed)
        pattern = [rng.random() < level for _ in range(n_drafted)]
        if sum(pattern) == want:
            return seed, pattern
    raise ConfigError(f"No router seed below {limit} accepts exactly {want} of {n_drafted} blocks at rate {level}.")


# ----------------------------------------------------------------------------------------------------------
# call tracing


class Instrument:
    """Wraps model methods on the instances to time every call; optionally forces the reward decisions."""

    def __init__(self, device: torch.device | None = None, *, sanitize_frames: bool = False):
        self.device = device
        self.sanitize_frames = sanitize_frames
        self.events: list[tuple[str, float, float, tuple]] = []  # (kind, start, end, signature)
        self.score_pattern: list[bool] | None = None
        self.score_calls = 0
        self._lock = threading.Lock()
        self._installed: list[tuple[object, str]] = []

    def sync(self) -> None:
        """Wait for the device (CUDA) so that a host clock reading covers the work queued so far."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wrap(self, obj, attr: str, kind: str, post: Callable | None = None,
              signature: Callable[..., tuple] | None = None) -> None:
        original = getattr(obj, attr)

        def traced(*args, **kwargs):
            sig = signature(*args, **kwargs) if signature is not None else ()
            self.sync()
            start = time.perf_counter()
            try:
                out = original(*args, **kwargs)
                self.sync()
            finally:
                end = time.perf_counter()
                self.events.append((kind, start, end, sig))
            return post(out) if post is not None else out

        setattr(obj, attr, traced)  # an instance attribute shadows the class method
        self._installed.append((obj, attr))

    def install(self, models) -> Instrument:
        for name in ("target", "drafter"):
            model = getattr(models, name, None)
            if model is not None:
                self._wrap(model, "forward_block", name, signature=_forward_signature)
                self._wrap(model, "prepare_cross_attention", "setup")
        vae = models.vae
        self._wrap(vae, "decode_block", "decode", self._post_decode if self.sanitize_frames else None,
                   signature=lambda latents, *a, **k: (vae.frames_decoded == 0, int(latents.shape[2])))
        self._wrap(vae, "encode_frame", "encode")  # recompute: the re-encoded first context frame
        if getattr(models, "reward", None) is not None:
            self._wrap(models.reward, "score", "score", self._post_score,
                       signature=lambda frames, *a, **k: (int(frames.shape[0]),))
        return self

    def uninstall(self) -> None:
        for obj, attr in reversed(self._installed):
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
        self._installed.clear()

    @staticmethod
    def _post_decode(frames: torch.Tensor) -> torch.Tensor:
        # random real-size VAE weights may overflow bf16; keep the reward model's input valid (timing unaffected)
        return frames.nan_to_num_(0.5)

    def _post_score(self, scores: torch.Tensor) -> torch.Tensor:
        if self.score_pattern is None:
            return scores
        with self._lock:
            i, self.score_calls = self.score_calls, self.score_calls + 1
        accept = self.score_pattern[i] if i < len(self.score_pattern) else False
        return torch.full_like(scores, 1.0 if accept else -1.0)


def _forward_signature(x, t, self_kv, cross, *, frame_offset: int = 0, write: bool = True, **_) -> tuple:
    """What a DiT forward's cost depends on besides the model: where the block sits (its attended context grows with
    the frame offset until the window is full), how many frames it carries, and whether it writes the cache."""
    return (int(frame_offset), int(x.shape[2]), bool(write))


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


# ----------------------------------------------------------------------------------------------------------
# memory


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM from /proc (resettable), else the lifetime peak from getrusage."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def kv_bytes_for(model, regime: str, num_frames: int, latent_hw: tuple[int, int], window: int, sinks: int) -> int:
    """Self-attention KV-cache bytes the sampler allocates for ``model`` (the denoiser's own capacity rule)."""
    from .kv_cache import kv_cache_nbytes
    from .regimes import CacheConfig

    cache = CacheConfig(regime=regime, window_frames=window, sink_frames=sinks)
    cap = cache.policy().layout(num_frames).capacity_frames
    return kv_cache_nbytes(
        num_layers=len(model.blocks), capacity_frames=cap, tokens_per_frame=model.tokens_per_frame(*latent_hw),
        heads=model.num_heads, head_dim=model.head_dim, dtype=model.compute_dtype,
    )


# ----------------------------------------------------------------------------------------------------------
# settings, one run


@dataclass
class BenchSettings:
    profile: str = "tiny"
    blocks: int = 9
    width: int = 64
    height: int = 64
    seed: int = 0
    repeats: int = 5
    warmup: int = 1
    threads: int | None = None
    levels: tuple[float, ...] = LEVELS
    window: int = 12
    sinks: int = 3
    prompt: str = BENCH_PROMPT
    only: tuple[str, ...] = ()  # variant groups or names to run (empty: all)
    # Rows per interleaved group, each group with its own target-only run (0: every run on its own, one after
    # another; None: 2 on the tiny profile, 0 at real size, where a second live 14B KV cache may not fit).
    # See run_bench.
    interleave: int | None = None

    @property
    def groups_of(self) -> int:
        """The interleave in force."""
        if self.interleave is not None:
            return self.interleave
        return 0 if self.profile == "real-size" else 2


@dataclass
class RunMeasure:
    wall: float
    busy: float  # |union of the traced call intervals|
    phases: dict[str, float]
    per_block: list[float]
    decisions: list[str]
    produced_by: list[str]
    # Elapsed time between consecutive finished blocks (the first one includes the per-video setup) and, last,
    # the tail after the final block: they add up to ``wall`` exactly, pipelined or not.
    segments: list[float] = field(default_factory=list)
    # Every traced call in order: (kind, signature, seconds).
    calls: list[tuple[str, tuple, float]] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in CALL_KINDS}
        for kind, _sig, _sec in self.calls:
            out[kind] += 1
        return out

    @property
    def call_seconds(self) -> dict[str, float]:
        out = {k: 0.0 for k in CALL_KINDS}
        for kind, _sig, sec in self.calls:
            out[kind] += sec
        return out

    @property
    def in_calls(self) -> float:
        return sum(sec for _kind, _sig, sec in self.calls)


def _configs(v: Variant, s: BenchSettings, pattern_seed: int):
    from .regimes import CacheConfig
    from .router import RouterConfig
    from .sampler import SamplerConfig

    if v.router == "random":
        router = RouterConfig(mode="random", random_rate=float(v.level), seed=pattern_seed)
    elif v.router == "scored":
        router = RouterConfig(mode="reward", tau=0.0, aggregation="min", threshold="fixed")
    elif v.router in ("target-only", "draft-only"):
        router = RouterConfig(mode=v.router)
    else:
        raise ConfigError(f"Unknown bench router {v.router!r}.")
    config = SamplerConfig(
        num_blocks=s.blocks, width=s.width, height=s.height, seed=s.seed,
        cache=CacheConfig(regime=v.regime, window_frames=s.window, sink_frames=s.sinks),
        schedule=v.schedule, pipelined=v.pipelined, refine_from_step=v.refine_from_step,
    )
    return router, config


class LiveRun:
    """One sampler run advanced one block at a time, so that several runs can be interleaved block by block.

    Each :meth:`step` is one ``next()`` of :meth:`SpeculativeSampler.generate`: the first one holds the per-video
    setup and block 0, the last one the tail after the final block; their durations are the run's *segments*, and
    their sum its wall time. Runs share the models: the streaming VAE's decoder state is swapped in and out around
    each step (``snapshot``/``restore`` hold references, no copies) and the tracer's per-run state with it. The
    DiT caches belong to each run's own denoisers already.
    """

    def __init__(self, models, v: Variant, s: BenchSettings, embeds: torch.Tensor,
                 pattern: tuple[int, list[bool]] | None):
        from .sampler import SpeculativeSampler

        seed, accept = pattern if pattern is not None else (0, None)
        router, config = _configs(v, s, seed)
        self.variant = v
        self.vae = models.vae
        self._gen = SpeculativeSampler(models, router, config).generate(s.prompt, prompt_embeds=embeds)
        self._score_pattern = accept if v.router == "scored" else None
        self._score_calls = 0
        self._vae_state = None
        self.events: list[tuple[str, float, float, tuple]] = []
        self.segments: list[float] = []
        self.result = None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def step(self, instr: Instrument) -> None:
        if self._vae_state is not None:
            self.vae.restore(self._vae_state)
        instr.events, instr.score_pattern, instr.score_calls = self.events, self._score_pattern, self._score_calls
        start = time.perf_counter()
        try:
            next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
        finally:
            instr.sync()
            end = time.perf_counter()
            self.segments.append(end - start)
            self._score_calls = instr.score_calls
            self._vae_state = None if self.finished else self.vae.snapshot()
            instr.events, instr.score_pattern = [], None

    def measure(self) -> RunMeasure:
        result, events = self.result, self.events
        phases = {p: 0.0 for p in PHASES}
        per_block = []
        for r in result.blocks:
            per_block.append(sum(val for k, val in r.timings.items() if k != "verify_wait"))
            for k, val in r.timings.items():
                phases[k] = phases.get(k, 0.0) + val
        return RunMeasure(
            wall=sum(self.segments), busy=busy_seconds([(a, b) for _, a, b, _ in events]), phases=phases,
            per_block=per_block,
            decisions=[r.decision for r in result.blocks], produced_by=[r.produced_by for r in result.blocks],
            segments=list(self.segments),
            calls=[(kind, sig, b - a) for kind, a, b, sig in sorted(events, key=lambda e: e[1])],
        )


def run_interleaved(runs: Sequence[LiveRun], instr: Instrument) -> None:
    """Advance ``runs`` in rounds, one block of each per round in the given order, until all have finished."""
    while not all(r.finished for r in runs):
        for r in runs:
            if not r.finished:
                r.step(instr)


def run_once(models, v: Variant, s: BenchSettings, instr: Instrument, embeds: torch.Tensor,
             pattern: tuple[int, list[bool]] | None) -> tuple[RunMeasure, Any]:
    """One run on its own, start to finish."""
    live = LiveRun(models, v, s, embeds, pattern)
    run_interleaved([live], instr)
    return live.measure(), live.result


# ----------------------------------------------------------------------------------------------------------
# cost model


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

    A run is a sequence of block segments (time from one finished block to the next) whose work is the same in every
    pass (same calls, checked: ``consistent_across_repeats``). Interference from the rest of the machine only ever
    adds time, and on a shared VM it comes in bursts of about a second: the fastest pass of each ~0.2–0.5 s segment is
    its undisturbed time far more often than one whole 1–5 s run is undisturbed. Falls back to the fastest whole
    run when the segment lists differ (they never do for a finished run).
    """
    n = len(runs[0].segments)
    if n == 0 or any(len(r.segments) != n for r in runs):
        return min(r.wall for r in runs)
    return sum(min(r.segments[i] for r in runs) for i in range(n))


def pattern_counts(accept: Sequence[bool], *, steps: Sequence[int], scored: bool = True,
                   refine_from_step: int | None = None) -> dict[str, int]:
    """Calls a plain (non-pipelined) recompute-regime run needs for an acceptance pattern over drafted blocks
    1..N-1 (block 0 is the target's). The analytic twin of the traced counts: the report cross-checks them.

    Every denoise of a block b ≥ 1 adds one context-refill forward; blocks b ≥ 2 re-encode one pixel frame; a
    rejected block is decoded twice (draft, then the target's block); refine-on-reject from step k runs the
    target's steps k..n-1 only.
    """
    n = len(steps)
    if len(accept) != n - 1:
        raise ConfigError(f"The pattern has {len(accept)} entries for {n - 1} drafted blocks.")
    # One re-encoded first context frame per block from block 2 on, shared by both models (SamplerConfig.first_frame).
    c = {"target": steps[0], "drafter": 0, "decode": 1, "score": 0, "encode": max(0, n - 2)}
    for b in range(1, n):
        c["drafter"] += steps[b] + 1
        c["decode"] += 1
        c["score"] += 1 if scored else 0
        if not accept[b - 1]:
            k = refine_from_step if refine_from_step is not None and refine_from_step < steps[b] else 0
            c["target"] += steps[b] - k + 1
            c["decode"] += 1
    return c


# ----------------------------------------------------------------------------------------------------------
# the bench


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def steady_start(regime: str, schedule: str, window: int = 12) -> int:
    """First block whose per-block work no longer changes by design: block 1 (recompute/global), the first block
    with a full rolling window (noisy), and not before block 2 under the diagonal schedule (fewer steps later)."""
    start = 1
    if regime == "noisy":
        start = max(start, math.ceil(window / 3))
    if schedule == "diagonal":
        start = max(start, 2)
    return start


def _growth(per_block: Sequence[float], start: int = 1) -> float | None:
    """mean(second half of the steady blocks) / mean(first half) − 1: 0 means flat. None with fewer than 4 steady
    blocks (a half of one block says nothing about a trend)."""
    xs = list(per_block[start:])
    if len(xs) < 4:
        return None
    k = len(xs) // 2
    first, last = statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])
    return last / first - 1.0 if first > 0 else None


def _select(variants: list[Variant], only: Sequence[str]) -> list[Variant]:
    if not only:
        return variants
    unknown = [o for o in only if not any(v.group == o or v.name == o for v in variants)]
    if unknown:
        groups = ", ".join(dict.fromkeys(v.group for v in variants))
        raise ConfigError(f"--only: no row or group named {', '.join(map(repr, unknown))}. Groups: {groups}; "
                          "or a row name from the table, e.g. 'scored @75%'.")
    keep = [v for v in variants if v.group in only or v.name in only or v.group == "baseline" and v.router == "target-only"
            and v.regime == "recompute"]
    return keep


def _pass_groups(variants: list[Variant], base: Variant, s: BenchSettings, rep: int) -> list[list[Variant]]:
    """Timed pass ``rep``: the rows in a seeded random order; interleaved, cut into groups of ``s.groups_of`` rows,
    each with the baseline at a seeded random place in the round. Not interleaved: one row per group."""
    order = list(variants)
    random.Random(s.seed * 7919 + rep).shuffle(order)
    k = s.groups_of
    others = [v for v in order if v is not base]
    if not k or not others:
        return [[v] for v in order]
    groups = [[base, *others[i:i + k]] for i in range(0, len(others), k)]
    for g in groups:
        random.Random(f"{s.seed}/{rep}/{g[1].name}").shuffle(g)
    return groups


class _OnceFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def run_bench(models, s: BenchSettings, *, device: torch.device, embeds: torch.Tensor,
              variants: list[Variant] | None = None, log: Callable[[str], None] | None = None,
              sanitize_frames: bool = False, extra: dict | None = None) -> dict:
    """Run every variant in one process and return the JSON-able report.

    Warm-up passes run every row on its own; they also give each row's peak memory, measured without other runs
    alive. Timed passes (``repeats``) run every row once, in a seeded random order per pass, so slow drifts of a
    shared machine hit all rows alike and a disturbance that recurs with the pass's rhythm does not land on the
    same neighbours every time. With ``interleave = k > 0`` a pass cuts the rows into groups of k, and each group
    runs *together with its own target-only run*, one block of each in turn (:class:`LiveRun`): a row's blocks and
    its baseline's blocks run within about a second of each other, so the machine's bursts hit both; the row's
    speedup compares it with those baseline runs block by block (:func:`paired_speedup`). ``interleave = 0`` runs
    every run on its own (what the real-size profile does: more live 14B KV caches need not fit on every GPU).
    """
    variants = _select(variants if variants is not None else default_variants(s.profile, s.levels), s.only)
    base = next((v for v in variants if v.router == "target-only" and v.baseline_key == "recompute/constant"), None)
    if base is None:
        base = Variant("target-only", "target-only", group="baseline")
        variants.insert(0, base)
    n_drafted = s.blocks - 1
    if n_drafted < 1:
        raise ConfigError("The bench needs at least 2 blocks (block 0 is always the target's).")
    if s.groups_of < 0:
        raise ConfigError("interleave must be ≥ 0 (0: no interleaving).")
    patterns: dict[float, tuple[int, list[bool]]] = {}
    for v in variants:
        if v.level is not None and v.level not in patterns:
            patterns[v.level] = exact_pattern_seed(n_drafted, v.level)
    instr = Instrument(device, sanitize_frames=sanitize_frames).install(models)
    once = _OnceFilter()  # the sampler's per-run warnings (pipelined on the CPU), once per bench, not once per run
    logging.getLogger("sdvg.sampler").addFilter(once)
    latent_hw = (s.height // 8, s.width // 8)
    measured: dict[str, list[RunMeasure]] = {v.name: [] for v in variants}
    # interleaved: the baseline runs once per group; one of them per pass counts as the baseline row's run (so its
    # statistics rest on as many runs as every other row's), all of them feed the cost table and the pairing
    more_base_runs: list[RunMeasure] = []
    paired: dict[str, list[list[float]]] = {v.name: [] for v in variants}  # the beside-run baseline's segments
    peaks: dict[str, list[int]] = {}
    cuda_peaks: dict[str, list[int]] = {}
    group_peaks: dict[str, int] = {}
    last: dict[str, Any] = {}
    passes: list[list[list[str]]] = []

    def live(v: Variant) -> LiveRun:
        return LiveRun(models, v, s, embeds, patterns.get(v.level))

    def alone(v: Variant) -> tuple[RunMeasure, Any]:
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        m, result = run_once(models, v, s, instr, embeds, patterns.get(v.level))
        peaks.setdefault(v.name, []).append(peak_rss_bytes())
        if device.type == "cuda":
            cuda_peaks.setdefault(v.name, []).append(torch.cuda.max_memory_allocated(device))
        return m, result

    try:
        for _ in range(s.warmup):
            for v in variants:
                alone(v)
        for rep in range(max(1, s.repeats)):
            groups = _pass_groups(variants, base, s, rep)
            passes.append([[v.name for v in g] for g in groups])
            for gi, g in enumerate(groups):
                if len(g) > 1:
                    runs = [live(v) for v in g]
                    reset_peak_rss()
                    run_interleaved(runs, instr)
                    got = {r.variant.name: (r.measure(), r.result) for r in runs}
                    for v in g:  # without a warm-up, a row's peak is its group's (an upper bound)
                        group_peaks[v.name] = max(group_peaks.get(v.name, 0), peak_rss_bytes())
                else:
                    got = {g[0].name: alone(g[0])}
                for name, (m, result) in got.items():
                    if name == base.name and len(g) > 1 and gi > 0:
                        more_base_runs.append(m)
                    else:
                        measured[name].append(m)
                        last[name] = result
                        if log:
                            log(f"  [{rep + 1}/{s.repeats}] {name:26s} wall {m.wall:.3f}s")
                if len(g) > 1:
                    for name in got:
                        if name != base.name:
                            paired[name].append(got[base.name][0].segments)
    finally:
        instr.uninstall()
        logging.getLogger("sdvg.sampler").removeFilter(once)
    rows: list[dict] = []
    for v in variants:
        row = _row_basics(v, measured[v.name], patterns.get(v.level), models, s, latent_hw, last[v.name])
        if v.name in peaks:
            row["peak_rss_bytes"], row["peak_measured"] = max(peaks[v.name]), "alone"
            row["cuda_peak_bytes"] = max(cuda_peaks[v.name]) if v.name in cuda_peaks else None
        else:
            row["peak_rss_bytes"], row["cuda_peak_bytes"] = group_peaks.get(v.name), None
            row["peak_measured"] = "with its interleaved group"
        if paired[v.name]:
            row["paired_base_segments_s"] = paired[v.name]
            row["paired_speedups"] = [sum(b) / m.wall for b, m in zip(paired[v.name], measured[v.name], strict=True)]
        else:
            row["paired_base_segments_s"] = row["paired_speedups"] = None
        rows.append(row)
    return _finish_report(rows, variants, measured, s, device, {"passes": passes, **(extra or {})},
                          more_runs={base.name: more_base_runs})


def _row_basics(v: Variant, runs: list[RunMeasure], pattern, models, s: BenchSettings, latent_hw, result) -> dict:
    first = runs[0]
    accepted = sum(1 for r in result.blocks if r.drafted and r.decision == "accept")
    n_drafted = sum(1 for r in result.blocks if r.drafted)
    consistent = all(r.counts == first.counts and r.decisions == first.decisions for r in runs)
    expected = None
    if pattern is not None:
        expected = pattern[1]
    realized = [r.decision == "accept" for r in result.blocks if r.drafted and r.block >= 1]
    model_calls = None
    if v.regime == "recompute" and not v.pipelined and v.router in ("random", "scored"):
        steps = [len(x) for x in result.settings["schedule"]]
        model_calls = pattern_counts(realized, steps=steps, scored=v.router == "scored",
                                     refine_from_step=v.refine_from_step)
    kv = {}
    for name in ("target", "drafter"):
        model = getattr(models, name)
        used = v.router != ("draft-only" if name == "target" else "target-only")
        if model is not None and used:
            kv[name] = kv_bytes_for(model, v.regime, s.blocks * 3, latent_hw, s.window, s.sinks)
    return {
        "name": v.name, "group": v.group, "router": v.router, "level": v.level, "regime": v.regime,
        "schedule": v.schedule, "pipelined": v.pipelined, "refine_from_step": v.refine_from_step,
        "router_seed": pattern[0] if pattern is not None and v.router == "random" else None,
        "pattern_expected": expected, "pattern_realized": realized if v.level is not None else None,
        "pattern_ok": (expected == realized) if expected is not None else None,
        "acceptance": (accepted / n_drafted) if n_drafted else None,
        "accepted": accepted, "drafted": n_drafted,
        "repeats": len(runs), "consistent_across_repeats": consistent,
        "wall_s": segment_min_wall(runs), "wall_median_s": _median([r.wall for r in runs]),
        "wall_min_s": min(r.wall for r in runs), "wall_all_s": [r.wall for r in runs],
        "segments_all_s": [r.segments for r in runs],
        "busy_s": _median([r.busy for r in runs]), "in_calls_s": _median([r.in_calls for r in runs]),
        "overhead": _median([1.0 - r.busy / r.wall for r in runs if r.wall > 0]),
        "phase_s": {p: _median([r.phases.get(p, 0.0) for r in runs]) for p in PHASES},
        "call_s": {k: _median([r.call_seconds[k] for r in runs]) for k in CALL_KINDS},
        "calls": dict(first.counts),
        "calls_match_model": (all(first.counts[k] == n for k, n in model_calls.items())
                              if model_calls is not None else None),
        # per block: its segment (elapsed time from the previous block's end), fastest pass, as for wall_s
        "per_block_s": [min(r.segments[i] for r in runs) for i in range(len(first.per_block))],
        "per_block_phase_s": [_median([r.per_block[i] for r in runs]) for i in range(len(first.per_block))],
        "kv_cache_bytes": kv,
        "vae_cache_bytes": int(models.vae.cache_nbytes),
        "vae_snapshot_bytes": int(models.vae.cache_nbytes),  # a snapshot references the live entries
    }


def _finish_report(rows, variants, measured, s: BenchSettings, device, extra,
                   more_runs: dict[str, list[RunMeasure]] | None = None) -> dict:
    by_regime: dict[str, list[RunMeasure]] = {}
    vmap = {v.name: v for v in variants}
    more_runs = more_runs or {}
    for name, runs in measured.items():
        by_regime.setdefault(vmap[name].regime, []).extend([*runs, *more_runs.get(name, [])])
    pooled = CostModel.from_runs([r for runs in by_regime.values() for r in runs])
    tables = {reg: CostModel.from_runs(runs).with_fallback(pooled) for reg, runs in by_regime.items()}
    base = next(r for r in rows if r["router"] == "target-only" and r["regime"] == "recompute"
                and r["schedule"] == "constant")
    base_pred = tables["recompute"].predict(measured[base["name"]][0].calls)
    for row in rows:
        runs = measured[row["name"]]
        pred = tables[row["regime"]].predict(runs[0].calls)
        row["predicted_s"] = pred
        row["bound"] = base_pred / pred if pred > 0 else None
        for suffix, key in (("_segment", "wall_s"), ("_median_wall", "wall_median_s"), ("_min_wall", "wall_min_s")):
            speedup = base[key] / row[key] if row[key] else None
            row["speedup" + suffix] = speedup
            row["efficiency" + suffix] = speedup / row["bound"] if speedup and row["bound"] else None
        # the primary speedup: paired with the baseline run interleaved beside it when there is one
        if row["paired_base_segments_s"]:
            row["speedup"] = paired_speedup(row["paired_base_segments_s"], row["segments_all_s"])
            row["speedup_estimator"] = "paired per block (median over passes)"
        elif row is base:
            row["speedup"], row["speedup_estimator"] = 1.0, "baseline"
        else:
            row["speedup"], row["speedup_estimator"] = row["speedup_segment"], "segment minimum"
        row["efficiency"] = row["speedup"] / row["bound"] if row["speedup"] and row["bound"] else None
        row["model_time_share"] = pred / row["wall_s"] if row["wall_s"] else None
        # > 1: this row's calls ran slower than the same calls elsewhere in the run (the pipelined rows' two threads,
        # or machine noise, which the paired speedup cancels and this unpaired ratio does not)
        own = CostModel.from_runs(runs)
        row["call_slowdown"] = own.predict(runs[0].calls) / pred if pred > 0 else None
    rec = tables.get("recompute", pooled).by_kind
    ratio = rec["target"] / rec["drafter"] if rec.get("target") and rec.get("drafter") else None
    report = {
        "schema": SCHEMA,
        "settings": {**asdict(s), "interleave": s.groups_of, "levels": list(s.levels), "only": list(s.only),
                     "order": "shuffled per pass"},
        "machine": _machine(device),
        "cost_model": {
            "definition": "cost(call) = median seconds of that call (kind + signature), pooled over the timed runs "
                          "of the same cache regime in this bench run; predicted = Σ cost over the row's calls; "
                          "bound = predicted(target-only) / predicted(row); wall = Σ over block segments of the "
                          "fastest pass; speedup = Σ_i B_i / Σ_i r_i·B_i over block segments i, r_i = median over "
                          "passes of row_i / base_i of the target-only run interleaved beside the row, B_i = median "
                          "of base_i (without interleaving: wall(target-only) / wall(row)); "
                          "efficiency = speedup / bound (efficiency_segment / _median_wall / _min_wall: with the "
                          "ratio of segment-minimum / median / fastest whole-run walls); "
                          "call_slowdown = predicted with the row's own medians / predicted; "
                          "overhead = 1 − |union of traced call intervals| / wall",
            "per_call_s": {reg: t.by_kind for reg, t in tables.items()}, "pooled_per_call_s": pooled.by_kind,
            "per_signature_s": {reg: t.as_json() for reg, t in tables.items()},
            "target_over_drafter_forward": ratio,
        },
        "rows": rows,
        **extra,
    }
    report["goals"] = evaluate_goals(report)
    return report


def _machine(device: torch.device) -> dict:
    info = {
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def evaluate_goals(report: dict) -> dict:
    """The issue's goals, checked on this run's numbers."""
    rows = report["rows"]
    sweep = [r for r in rows if r["group"] in ("random", "scored")]
    eff = [r["efficiency"] for r in sweep if r["efficiency"] is not None]
    cross = {key: [r[key] for r in sweep if r.get(key) is not None]
             for key in ("efficiency_segment", "efficiency_median_wall", "efficiency_min_wall")}
    ovh = [r["overhead"] for r in rows if r["overhead"] is not None]
    flat = {}
    for r in rows:
        if r["router"] == "target-only":
            key = f"{r['regime']}/{r['schedule']}"
            window = report.get("settings", {}).get("window", 12)
            flat[key] = _growth(r["per_block_s"], steady_start(r["regime"], r["schedule"], window))
    pipe = {}
    for r in rows:
        if r["group"] == "pipelined" and r["level"] is not None:
            plain = next((p for p in rows if p["group"] == "scored" and p["level"] == r["level"]), None)
            if plain is not None:
                # the same estimator as the efficiency: both speedups are against the baseline (paired when
                # interleaved), so pipelined / plain − 1 is the gain; the walls are shown beside it
                paired = r.get("speedup") and plain.get("speedup")
                pipe[f"{round(r['level'] * 100)}%"] = {
                    "plain_s": plain["wall_s"], "pipelined_s": r["wall_s"],
                    "plain_speedup": plain.get("speedup"), "pipelined_speedup": r.get("speedup"),
                    "gain": (r["speedup"] / plain["speedup"] if paired else plain["wall_s"] / r["wall_s"]) - 1.0,
                    "gain_from_walls": plain["wall_s"] / r["wall_s"] - 1.0,
                }
    hi = [v for k, v in pipe.items() if int(k[:-1]) >= 75]
    flat_keys = [k for k in flat if k.startswith(("recompute", "noisy"))]
    return {
        "efficiency_min": min(eff) if eff else None,
        "efficiency_ok": bool(eff) and min(eff) >= GOAL_EFFICIENCY,
        # the same sweep with the unpaired walls (segment minimum, median, fastest whole run): how much the estimator
        # matters on this machine
        **{f"{key}_min": (min(v) if v else None) for key, v in cross.items()},
        "overhead_max": max(ovh) if ovh else None,
        "overhead_ok": bool(ovh) and max(ovh) <= GOAL_OVERHEAD,
        "per_block_growth": flat,
        "flat_ok": (all(abs(flat[k]) <= GOAL_FLAT_GROWTH for k in flat_keys if flat[k] is not None)
                    if any(flat[k] is not None for k in flat_keys) else None),
        "pipelined": pipe,
        "pipelined_ok": all(p["gain"] > 0 for p in hi) if hi else None,
    }


# ----------------------------------------------------------------------------------------------------------
# output


def _fmt_pct(x) -> str:
    return "   —" if x is None else f"{x * 100:4.0f}%"


def _f(x, spec: str, width: int) -> str:
    return f"{'—':>{width}}" if x is None else f"{x:{width}{spec}}"


def format_table(report: dict) -> str:
    head = (f"{'variant':26s} {'acc':>5s} {'wall s':>7s} {'speedup':>7s} {'bound':>6s} {'eff':>5s} {'eff/s':>5s} {'ovh':>5s} "
            f"{'slow':>5s} {'draft':>6s} {'decode':>6s} {'score':>6s} {'target':>6s} {'cache':>6s} {'wait':>6s} {'rss MB':>7s}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        ph = r["phase_s"]
        lines.append(
            f"{r['name']:26s} {_fmt_pct(r['acceptance']):>5s} {_f(r['wall_s'], '.3f', 7)} {_f(r['speedup'], '.2f', 6)}× "
            f"{_f(r['bound'], '.2f', 5)}× {_f(r['efficiency'], '.2f', 5)} {_f(r.get('efficiency_segment'), '.2f', 5)} "
            f"{_f((r['overhead'] or 0) * 100, '.1f', 4)}% "
            f"{_f(r.get('call_slowdown'), '.2f', 5)} "
            f"{_f(ph.get('draft'), '.3f', 6)} {_f(ph.get('decode'), '.3f', 6)} {_f(ph.get('score'), '.3f', 6)} "
            f"{_f(ph.get('target'), '.3f', 6)} {_f(ph.get('cache'), '.3f', 6)} {_f(ph.get('verify_wait'), '.3f', 6)} "
            f"{_f((r['peak_rss_bytes'] or 0) / 2**20, '.0f', 7)}"
        )
    cm = report["cost_model"]
    rec = cm["per_call_s"].get("recompute", cm["pooled_per_call_s"])
    ms = ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in rec.items() if v is not None)
    lines.append("")
    est = next((r.get("speedup_estimator") for r in report["rows"] if r.get("paired_speedups")), "segment minimum")
    lines.append(f"speedup: {est}; wall s: Σ over block segments of the fastest pass; "
                 "eff/s: efficiency from the ratio of those walls")
    lines.append(f"per-call median (recompute): {ms}")
    ratio = cm["target_over_drafter_forward"]
    lines.append(f"target/drafter forward cost ratio: {ratio:.1f}×" if ratio else "target/drafter ratio: n/a")
    g = report["goals"]
    lines.append(
        f"goals: efficiency min {_f(g['efficiency_min'], '.3f', 0)} (≥ {GOAL_EFFICIENCY}: {g['efficiency_ok']}; "
        f"eff/s min {_f(g.get('efficiency_segment_min'), '.3f', 0)}, from median walls "
        f"{_f(g.get('efficiency_median_wall_min'), '.3f', 0)}); "
        f"overhead max {_f((g['overhead_max'] or 0) * 100, '.2f', 0)}% (≤ {GOAL_OVERHEAD * 100:.0f}%: {g['overhead_ok']}); "
        f"flat per-block {g['flat_ok']}; pipelined faster at ≥75%: {g['pipelined_ok']}"
    )
    growth = ", ".join(f"{k} {v * 100:+.1f}%" for k, v in g["per_block_growth"].items() if v is not None)
    lines.append(f"per-block time growth over the steady blocks, 2nd half vs 1st half (target-only): {growth}")
    if g["pipelined"]:
        lines.append("pipelined vs plain (speedup; walls): " + ", ".join(
            f"{k} {_f(p.get('plain_speedup'), '.2f', 0)}× → {_f(p.get('pipelined_speedup'), '.2f', 0)}× "
            f"({p['gain'] * 100:+.1f}%; {p['plain_s']:.3f}s → {p['pipelined_s']:.3f}s)" for k, p in g["pipelined"].items()))
    m = report["machine"]
    lines.append(f"machine: {m['device']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['torch_threads']} intra-op thread(s)")
    return "\n".join(lines)


def render_plot(report: dict, path: str | Path, *, width: int = 820, height: int = 520) -> Path:
    """Speedup vs acceptance (PIL): measured points per group, the cost-model bound as a dashed line beside them."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [r for r in report["rows"] if r["level"] is not None and r["group"] in ("random", "scored", "pipelined")]
    img = Image.new("RGB", (width, height), (255, 255, 255))
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    left, right, top, bottom = 70, width - 190, 40, height - 60
    ys = [r["speedup"] for r in rows if r["speedup"]] + [r["bound"] for r in rows if r["bound"]] + [1.0]
    y_max = max(ys) * 1.1 if ys else 2.0
    y_min = min(0.0, min(ys))

    def px(x: float, y: float) -> tuple[float, float]:
        return left + x * (right - left), bottom - (y - y_min) / (y_max - y_min) * (bottom - top)

    d.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    for i in range(5):
        x = i / 4
        d.line([px(x, y_min), (px(x, y_min)[0], px(x, y_min)[1] + 5)], fill=(0, 0, 0))
        d.text((px(x, y_min)[0] - 10, bottom + 8), f"{int(x * 100)}%", fill=(0, 0, 0), font=font)
    steps = 6
    for i in range(steps + 1):
        y = y_min + (y_max - y_min) * i / steps
        d.line([(left - 5, px(0, y)[1]), (left, px(0, y)[1])], fill=(0, 0, 0))
        d.line([(left, px(0, y)[1]), (right, px(0, y)[1])], fill=(230, 230, 230))
        d.text((left - 45, px(0, y)[1] - 6), f"{y:.2f}x", fill=(0, 0, 0), font=font)
    d.line([px(0, 1.0), px(1, 1.0)], fill=(150, 150, 150))
    d.text((left + (right - left) / 2 - 60, bottom + 30), "acceptance of drafted blocks", fill=(0, 0, 0), font=font)
    d.text((left, 12), "SDVG bench: speedup over target-only (points) vs cost-model bound (dashed)", fill=(0, 0, 0),
           font=font)
    colors = {"random": (46, 120, 200), "scored": (219, 109, 40), "pipelined": (46, 160, 67)}
    legend_y = top
    for group, color in colors.items():
        pts = sorted((r["level"], r["speedup"], r["bound"]) for r in rows if r["group"] == group and r["speedup"])
        if not pts:
            continue
        bound_pts = [px(lv, b) for lv, _, b in pts if b]
        for a, b in zip(bound_pts, bound_pts[1:], strict=False):
            _dashed(d, a, b, color)
        meas = [px(lv, sp) for lv, sp, _ in pts]
        if len(meas) > 1:
            d.line(meas, fill=color, width=2)
        for x, y in meas:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        for x, y in bound_pts:
            d.rectangle([x - 3, y - 3, x + 3, y + 3], outline=color)
        d.ellipse([right + 15, legend_y + 2, right + 23, legend_y + 10], fill=color)
        d.text((right + 30, legend_y), f"{group} (measured)", fill=(0, 0, 0), font=font)
        legend_y += 16
        d.rectangle([right + 16, legend_y + 3, right + 22, legend_y + 9], outline=color)
        d.text((right + 30, legend_y), f"{group} (bound)", fill=(0, 0, 0), font=font)
        legend_y += 22
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def _dashed(d, a, b, color, dash: float = 6.0) -> None:
    (x0, y0), (x1, y1) = a, b
    length = math.hypot(x1 - x0, y1 - y0)
    n = max(1, int(length // dash))
    for i in range(0, n, 2):
        t0, t1 = i / n, min(1.0, (i + 1) / n)
        d.line([(x0 + (x1 - x0) * t0, y0 + (y1 - y0) * t0), (x0 + (x1 - x0) * t1, y0 + (y1 - y0) * t1)], fill=color,
               width=2)


# ----------------------------------------------------------------------------------------------------------
# real-size profile: random weights at the real shapes


REAL_WIDTH, REAL_HEIGHT = 832, 480


def _param_bytes(module) -> tuple[int, int]:
    n = sum(p.numel() for p in module.parameters())
    b = sum(p.numel() * p.element_size() for p in module.parameters())
    return n, b


def memory_plan(models, s: BenchSettings, regimes: Sequence[str] = ("recompute", "noisy", "global")) -> dict:
    """Parameters, KV-cache bytes per regime and the streaming-VAE cache bytes at the bench size (works on meta)."""
    latent_hw = (s.height // 8, s.width // 8)
    plan: dict[str, Any] = {"size": f"{s.width}x{s.height}", "blocks": s.blocks, "models": {}, "kv_cache_bytes": {}}
    for name in ("target", "drafter"):
        model = getattr(models, name)
        n, b = _param_bytes(model)
        plan["models"][name] = {"params": n, "bytes": b, "layers": len(model.blocks),
                                "dim": model.num_heads * model.head_dim}
        plan["kv_cache_bytes"][name] = {
            reg: kv_bytes_for(model, reg, s.blocks * 3, latent_hw, s.window, s.sinks) for reg in regimes
        }
    n, b = _param_bytes(models.vae.model)
    plan["models"]["vae"] = {"params": n, "bytes": b}
    n, b = _param_bytes(models.reward)
    plan["models"]["reward"] = {"params": n, "bytes": b}
    vae = models.vae
    vae.reset()
    dev, dt = vae.device, vae.dtype
    with torch.no_grad():
        for _ in range(2):  # the cache reaches its steady size after the first block
            vae.decode_block(torch.zeros((1, 16, 3, *latent_hw), device=dev, dtype=dt))
    plan["vae_cache_bytes"] = int(vae.cache_nbytes)
    plan["vae_snapshot_bytes"] = int(vae.cache_nbytes)
    vae.reset()
    weights = sum(m["bytes"] for m in plan["models"].values())
    plan["total_weights_bytes"] = weights
    plan["total_recompute_bytes"] = (weights + sum(v["recompute"] for v in plan["kv_cache_bytes"].values())
                                     + 2 * plan["vae_cache_bytes"])
    plan["note"] = ("weights + KV caches (recompute regime) + live VAE cache + one snapshot's worth of replaced entries; "
                    "activations and allocator slack are not included")
    return plan


def format_plan(plan: dict) -> str:
    gib = 2**30
    lines = [f"memory plan at {plan['size']}, {plan['blocks']} blocks (random weights, real shapes):"]
    for name, m in plan["models"].items():
        extra = f", {m['layers']} layers, dim {m['dim']}" if "layers" in m else ""
        lines.append(f"  {name:8s} {m['params'] / 1e9:7.3f} B params  {m['bytes'] / gib:7.2f} GiB{extra}")
    for name, kv in plan["kv_cache_bytes"].items():
        lines.append(f"  KV {name:8s} " + "  ".join(f"{reg} {b / gib:.2f} GiB" for reg, b in kv.items()))
    lines.append(f"  VAE decoder cache {plan['vae_cache_bytes'] / gib:.2f} GiB (a snapshot references it; a restore "
                 "keeps up to one more cache's worth alive)")
    lines.append(f"  total (weights + recompute KV + 2× VAE cache): {plan['total_recompute_bytes'] / gib:.1f} GiB; "
                 + plan["note"])
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# CLI


def _parse_levels(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) / (100.0 if float(x) > 1 else 1.0) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--levels must be numbers (0-1 or percent), got {text!r}.") from exc
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise ConfigError(f"--levels must be in [0, 1] (or 0-100 %), got {text!r}.")
    return vals


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="speed benchmark: target-only, draft-only, forced acceptance sweep, variants, cost-model bound",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--profile", choices=["tiny", "real-size"], default="tiny",
                   help="tiny: the tiny preset on the CPU (default); real-size: random weights at the real 1.3B/14B, "
                        "VAE and ImageReward shapes, 832×480, bf16, on a GPU")
    p.add_argument("--device", default=None, help="tiny: cpu (default); real-size: cuda (default)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per video (tiny 9, real-size 5: 8 / 4 drafted "
                   "blocks make 0/25/50/75/100 %% exact)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes over all rows (tiny 5, real-size 1)")
    p.add_argument("--interleave", type=int, default=None, help="rows per interleaved group: each group runs beside "
                   "its own target-only run, one block of each in turn, for a paired speedup (tiny 2; real-size 0 = "
                   "every run on its own)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per row before the timed ones (tiny 1, "
                   "real-size 0; real-size always does one global warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (tiny default 1: on small CPUs "
                   "more threads oversubscribe the cores for these tiny ops)")
    p.add_argument("--levels", default="0,25,50,75,100", help="forced acceptance levels in %% (default 0,25,50,75,100)")
    p.add_argument("--only", default="", help="comma list of row groups or names to run (baseline, random, scored, "
                   "pipelined, refine, noisy, diagonal, global); target-only always runs")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default=None, help="tiny profile: a make-tiny folder (default: the cached preset)")
    p.add_argument("--json", default=None, help="write the full report JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of speedup vs acceptance with the bound")
    p.add_argument("--dry-run", action="store_true", help="real-size: build everything on the meta device and print "
                   "the memory plan (params, KV bytes, VAE cache bytes); runs nothing")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    def log(msg: str) -> None:
        sys.stderr.write(msg + "\n")  # CLI output of the command

    real = args.profile == "real-size"
    s = BenchSettings(
        profile=args.profile,
        blocks=args.blocks or (5 if real else 9),
        width=args.width or (REAL_WIDTH if real else 64),
        height=args.height or (REAL_HEIGHT if real else 64),
        seed=args.seed,
        repeats=args.repeats if args.repeats is not None else (1 if real else 5),
        interleave=args.interleave,
        warmup=args.warmup if args.warmup is not None else (0 if real else 1),
        levels=_parse_levels(args.levels),
        only=tuple(x.strip() for x in args.only.split(",") if x.strip()),
    )
    if s.repeats < 1 or s.warmup < 0 or s.blocks < 2 or s.groups_of < 0:
        raise ConfigError("--repeats must be ≥ 1, --warmup ≥ 0, --interleave ≥ 0 and --blocks ≥ 2.")
    if real:
        return _cmd_real_size(args, s, log)
    return _cmd_tiny(args, s, log)


def _emit(report: dict, args, log) -> None:
    sys.stdout.write(format_table(report) + "\n")  # CLI output of the command
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n", encoding="utf-8")
        log(f"wrote {path}")
    if args.plot:
        log(f"wrote {render_plot(report, args.plot)}")


def _json_default(obj):
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    raise TypeError(f"not JSON-serializable: {type(obj).__name__}")


def _cmd_tiny(args, s: BenchSettings, log) -> int:
    from .devices import resolve_device
    from .fixtures.tiny import ensure_tiny
    from .pipeline import load_models

    device = resolve_device(args.device or "cpu", what="bench models")
    s.threads = set_cpu_threads(args.threads, 1 if device.type == "cpu" else None)
    models_dir = args.models
    if models_dir is None:
        models_dir, created = ensure_tiny()
        log(f"tiny preset: {models_dir} ({'created' if created else 'cached'})")
    models = load_models(models_dir, dit_device=str(device), aux_device=str(device),
                         dtype="fp32" if device.type == "cpu" else "auto")
    embeds = models.text_encoder.encode(s.prompt)
    log(f"bench: tiny profile on {device}, {s.blocks} blocks at {s.width}x{s.height}, {s.warmup} warm-up + "
        f"{s.repeats} timed run(s) per row, {s.threads} thread(s)")
    report = run_bench(models, s, device=device, embeds=embeds, log=log)
    _emit(report, args, log)
    return 0


def _cmd_real_size(args, s: BenchSettings, log) -> int:
    from .devices import resolve_device

    spec = RealSizeSpec()
    if args.dry_run:
        device = torch.device("meta")
        models = build_real_size_models(device, spec)
        plan = memory_plan(models, s)
        sys.stdout.write(format_plan(plan) + "\n")  # CLI output of the command
        variants = _select(default_variants("real-size", s.levels), s.only)
        sys.stdout.write(f"rows ({len(variants)}): " + ", ".join(v.name for v in variants) + "\n")  # CLI output of the command
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"schema": SCHEMA, "dry_run": True, "settings": asdict(s),
                                                   "memory_plan": plan, "rows": [asdict(v) for v in variants]},
                                                  indent=2, default=_json_default) + "\n", encoding="utf-8")
            log(f"wrote {args.json}")
        return 0
    device = resolve_device(args.device or "auto", what="real-size bench")
    if device.type != "cuda":
        raise ConfigError(
            "The real-size profile needs a CUDA GPU (two bf16 DiTs of 1.3B and 14B parameters at 832×480; about "
            "45 GB). This machine has none. Use `--profile real-size --dry-run` to print the memory plan on the CPU, "
            "or `--profile tiny` to benchmark here."
        )
    s.threads = set_cpu_threads(args.threads)
    t0 = time.perf_counter()
    models = build_real_size_models(device, spec)
    build_s = time.perf_counter() - t0
    log(f"built random real-size models on {device} in {build_s:.1f}s")
    gen = torch.Generator(device=device).manual_seed(0)
    embeds = torch.randn((1, spec.text_len, spec.text_dim), device=device, dtype=spec.dtype, generator=gen)
    plan = memory_plan(models, s)
    # one global warm-up: a scored 2-block run touches every model, kernel and allocator path
    warm = BenchSettings(**{**asdict(s), "blocks": 2, "repeats": 1, "warmup": 0})
    instr = Instrument(device, sanitize_frames=True).install(models)
    try:
        run_once(models, Variant("warm-up", "scored", 0.0), warm, instr, embeds, (0, [False]))
    finally:
        instr.uninstall()
    log(f"warm-up done ({time.perf_counter() - t0:.1f}s since start)")
    report = run_bench(models, s, device=device, embeds=embeds, variants=default_variants("real-size", s.levels),
                       log=log, sanitize_frames=True,
                       extra={"real_size": {"memory_plan": plan, "build_s": build_s,
                                            "approximations": REAL_SIZE_NOTES}})
    _emit(report, args, log)
    return 0


REAL_SIZE_NOTES = (
    "Random weights at the released shapes: drafter Wan 2.1 1.3B (30 layers, dim 1536), target 14B (40 layers, "
    "dim 5120), bf16; Wan 2.1 VAE base_dim 96 (bf16, as load_models does on CUDA); ImageReward v1.0 shapes (ViT-L/16 "
    "+ 12-layer BERT, fp32 as load_models loads it). Prompt embeddings are random [1, 512, 4096] (no UMT5 run: it "
    "runs once per prompt, outside the timed loop). The tokenizer is the tiny vocabulary (prompt length is padded to "
    "35 tokens either way). Decoded frames are NaN-sanitized before scoring (random VAE weights)."
)


__all__ = [
    "BenchSettings", "CostModel", "Instrument", "RunMeasure", "Variant", "add_parser", "busy_seconds",
    "build_real_size_models", "default_variants", "evaluate_goals", "exact_pattern_seed", "format_table",
    "memory_plan", "paired_speedup", "pattern_counts", "render_plot", "run_bench", "segment_min_wall",
]
