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
- Every model call is traced through the engine's call hooks (``sdvg/hooks.py``; a :class:`CallTracer` observer
  per run, no method replaced): the target's and the drafter's forwards, the cross-attention setup ("setup"), VAE
  decodes ("decode") and re-encodes ("encode") and ImageReward scoring ("score"), each with a *signature* (what its
  cost depends on: a forward's frame offset, frame count and cache write; first decode or not; frames scored). On
  CUDA the tracer waits for the device before and after each call, so its duration is its device time.
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

Acceptance is forced, so it does not depend on random weights: every row at a level accepts exactly that share of
its drafted blocks, at seeded random places, through the router's ``pattern`` mode (the realized pattern is checked
after each run). ``random`` rows decide by the pattern alone; ``scored`` rows also run the real SDVG verification
(snapshot, decode, ImageReward on every frame of every draft: ``score_drafts``), so the cost of scoring is paid as
in a real run while the decision is forced.

Modules: ``variants`` (the rows), ``tracing`` (call tracer, run measures, memory), ``costs`` (cost model, analytic
call counts, estimators), ``runner`` (live runs, interleaving, passes), ``report`` (rows, goals, table, plot),
``real_size`` (memory plan), ``cli``.
"""

from .costs import CostModel, paired_speedup, pattern_counts, segment_min_wall
from .real_size import memory_plan
from .report import SCHEMA, evaluate_goals, format_table, per_block_growth, render_plot
from .runner import BenchSettings, LiveRun, run_bench, run_interleaved, run_once
from .tracing import PHASES, CallTracer, RunMeasure, busy_seconds
from .variants import LEVELS, Variant, default_variants, level_pattern

__all__ = [
    "LEVELS", "PHASES", "SCHEMA", "BenchSettings", "CallTracer", "CostModel", "LiveRun", "RunMeasure", "Variant",
    "per_block_growth", "busy_seconds", "default_variants", "evaluate_goals", "format_table", "level_pattern", "memory_plan",
    "paired_speedup", "pattern_counts", "render_plot", "run_bench", "run_interleaved", "run_once", "segment_min_wall",
]
