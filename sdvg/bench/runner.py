"""Running the bench: settings, runs advanced block by block (so several can be interleaved), passes and rows.

Every row is run ``warmup`` times on its own, untimed (this also gives its peak memory), then ``repeats`` timed passes
run every row once each, in a seeded random order per pass. With ``interleave = k`` (tiny profile: 2) a pass runs its
rows in groups of k beside their own target-only run, one block of each in turn (:class:`LiveRun`,
:func:`run_interleaved`), so that a row and its baseline feel the same state of a shared machine.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..sampling.compat import Compat
from ..sampling.regimes import CacheConfig
from .report import finish_report
from .tracing import CallTracer, RunMeasure, peak_rss_bytes, reset_peak_rss
from .variants import LEVELS, Variant, configs, default_variants, is_baseline, level_pattern, select

BENCH_PROMPT = "a red fox running through fresh snow at sunrise, cinematic"


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
    window: int = CacheConfig.window_frames
    sinks: int = CacheConfig.sink_frames
    prompt: str = BENCH_PROMPT
    only: tuple[str, ...] = ()  # variant groups or names to run (empty: all)
    compat: Compat = field(default_factory=Compat)  # our defaults or the authors' behaviours (--compat reference)
    # Rows per interleaved group, each group with its own target-only run (0: every run on its own, one after
    # another; None: 2 on the tiny profile, 0 at real size, where a second live 14B KV cache may not fit).
    interleave: int | None = None

    @property
    def groups_of(self) -> int:
        """The interleave in force."""
        if self.interleave is not None:
            return self.interleave
        return 0 if self.profile == "real-size" else 2


class LiveRun:
    """One sampler run advanced one block at a time, so that several runs can be interleaved block by block.

    Each :meth:`step` is one ``next()`` of :meth:`SpeculativeSampler.generate`: the first one holds the per-video
    setup and block 0, the last one the tail after the final block; their durations are the run's *segments*, and
    their sum its wall time. Runs share the models: the streaming VAE's decoder state is swapped in and out around
    each step (``snapshot``/``restore`` hold references, no copies). The DiT caches belong to each run's own
    denoisers, and each run has its own call tracer (an observer of the engine's call hooks).
    """

    def __init__(self, models, v: Variant, s: BenchSettings, embeds: torch.Tensor, pattern: tuple[bool, ...] | None,
                 device: torch.device | None = None):
        from ..sampling.sampler import SpeculativeSampler

        router, config = configs(v, s, pattern)
        self.variant = v
        self.vae = models.vae
        self.tracer = CallTracer(device)
        self._gen = SpeculativeSampler(models, router, config).generate(s.prompt, prompt_embeds=embeds,
                                                                         observers=(self.tracer,))
        self._vae_state = None
        self.segments: list[float] = []
        self.result = None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def step(self) -> None:
        if self._vae_state is not None:
            self.vae.restore(self._vae_state)
        start = time.perf_counter()
        try:
            next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
        finally:
            self.tracer.sync()
            self.segments.append(time.perf_counter() - start)
            self._vae_state = None if self.finished else self.vae.snapshot()

    def measure(self) -> RunMeasure:
        return RunMeasure.of(self.result, self.tracer.events, self.segments)


def run_interleaved(runs: Sequence[LiveRun]) -> None:
    """Advance ``runs`` in rounds, one block of each per round in the given order, until all have finished."""
    while not all(r.finished for r in runs):
        for r in runs:
            if not r.finished:
                r.step()


def run_once(models, v: Variant, s: BenchSettings, embeds: torch.Tensor, pattern: tuple[bool, ...] | None,
             device: torch.device | None = None) -> tuple[RunMeasure, Any]:
    """One run on its own, start to finish."""
    live = LiveRun(models, v, s, embeds, pattern, device)
    run_interleaved([live])
    return live.measure(), live.result


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


class _Passes:
    """What the passes of one bench measured, row by row."""

    def __init__(self, models, s: BenchSettings, variants: list[Variant], base: Variant, device, embeds, log,
                 progress=None):
        self.models, self.s, self.variants, self.base, self.device, self.embeds, self.log = (
            models, s, variants, base, device, embeds, log)
        self.progress = progress
        n_drafted = s.blocks - 1
        self.patterns = {v.level: level_pattern(n_drafted, v.level, s.seed) for v in variants if v.level is not None}
        self.measured: dict[str, list[RunMeasure]] = {v.name: [] for v in variants}
        # interleaved: the baseline runs once per group; one of them per pass counts as the baseline row's run (so its
        # statistics rest on as many runs as every other row's), all of them feed the cost table and the pairing
        self.more_base_runs: list[RunMeasure] = []
        self.paired: dict[str, list[list[float]]] = {v.name: [] for v in variants}  # the beside-run baseline's segments
        self.peaks: dict[str, list[int]] = {}
        self.cuda_peaks: dict[str, list[int]] = {}
        self.group_peaks: dict[str, int] = {}
        self.last: dict[str, Any] = {}
        self.passes: list[list[list[str]]] = []

    def live(self, v: Variant) -> LiveRun:
        return LiveRun(self.models, v, self.s, self.embeds, self.patterns.get(v.level), self.device)

    def alone(self, v: Variant) -> tuple[RunMeasure, Any]:
        cuda = self.device.type == "cuda"
        reset_peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        m, result = run_once(self.models, v, self.s, self.embeds, self.patterns.get(v.level), self.device)
        self.peaks.setdefault(v.name, []).append(peak_rss_bytes())
        if cuda:
            self.cuda_peaks.setdefault(v.name, []).append(torch.cuda.max_memory_allocated(self.device))
        return m, result

    def group(self, g: list[Variant]) -> dict[str, tuple[RunMeasure, Any]]:
        if len(g) == 1:
            return {g[0].name: self.alone(g[0])}
        runs = [self.live(v) for v in g]
        reset_peak_rss()
        run_interleaved(runs)
        for v in g:  # without a warm-up, a row's peak is its group's (an upper bound)
            self.group_peaks[v.name] = max(self.group_peaks.get(v.name, 0), peak_rss_bytes())
        return {r.variant.name: (r.measure(), r.result) for r in runs}

    def timed_pass(self, rep: int) -> None:
        groups = _pass_groups(self.variants, self.base, self.s, rep)
        self.passes.append([[v.name for v in g] for g in groups])
        for gi, g in enumerate(groups):
            got = self.group(g)
            for name, (m, result) in got.items():
                if name == self.base.name and len(g) > 1 and gi > 0:
                    self.more_base_runs.append(m)
                    continue
                self.measured[name].append(m)
                self.last[name] = result
                if self.log:
                    self.log(f"  [{rep + 1}/{self.s.repeats}] {name:26s} wall {m.wall:.3f}s")
                if self.progress:
                    self.progress(name, m, self.cuda_peaks.get(name))
            if len(g) > 1:
                for name in got:
                    if name != self.base.name:
                        self.paired[name].append(got[self.base.name][0].segments)


def run_bench(models, s: BenchSettings, *, device: torch.device, embeds: torch.Tensor,
              variants: list[Variant] | None = None, log: Callable[[str], None] | None = None,
              extra: dict | None = None, progress: Callable[[str, RunMeasure, list[int] | None], None] | None = None,
              ) -> dict:
    """Run every variant in one process and return the JSON-able report (see the module docstring).

    Warm-up passes run every row on its own; they also give each row's peak memory, measured without other runs
    alive. Timed passes run every row once, in a seeded random order per pass, so slow drifts of a shared machine
    hit all rows alike. With ``interleave = k > 0`` each group of k rows runs *together with its own target-only
    run*, one block of each in turn, and a row's speedup compares it with those baseline runs block by block.
    ``interleave = 0`` runs every run on its own (the real-size default: more live 14B KV caches need not fit).
    ``progress(name, measure, cuda_peaks)`` is called after every timed run (the CLI writes a partial report with it).
    """
    variants = select(variants if variants is not None else default_variants(s.profile, s.levels), s.only)
    base = next((v for v in variants if is_baseline(v)), None)
    if base is None:
        base = Variant("target-only", "target-only", group="baseline")
        variants.insert(0, base)
    if s.blocks < 2:
        raise ConfigError("The bench needs at least 2 blocks (block 0 is always the target's).")
    if s.groups_of < 0:
        raise ConfigError("interleave must be ≥ 0 (0: no interleaving).")
    passes = _Passes(models, s, variants, base, device, embeds, log, progress)
    from ..sampling import sampler as sampler_module

    sampler_log = logging.getLogger(sampler_module.__name__)
    once = _OnceFilter()  # the sampler's per-run warnings (pipelined on the CPU), once per bench, not once per run
    sampler_log.addFilter(once)
    try:
        for _ in range(s.warmup):
            for v in variants:
                passes.alone(v)
        for rep in range(max(1, s.repeats)):
            passes.timed_pass(rep)
    finally:
        sampler_log.removeFilter(once)
    return finish_report(passes, {"passes": passes.passes, **(extra or {})})
