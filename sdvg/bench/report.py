"""The bench report: each row's figures, the cost-model bound and efficiency, the goals, the table and the plot."""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from ..sampling.calls import CALL_KINDS
from ..sampling.regimes import CacheConfig
from .costs import CostModel, kv_bytes_for, paired_speedup, pattern_counts, segment_min_wall
from .tracing import PHASES, RunMeasure

SCHEMA = "sdvg-bench/1"
GOAL_EFFICIENCY = 0.95
GOAL_OVERHEAD = 0.03
GOAL_FLAT_GROWTH = 0.10  # per-block time of the last third within 10 % of the first third (blocks ≥ 1)
COST_MODEL_DEFINITION = (
    "cost(call) = median seconds of that call (kind + signature), pooled over the timed runs of the same cache regime "
    "in this bench run; predicted = Σ cost over the row's calls; bound = predicted(target-only) / predicted(row); "
    "wall = Σ over block segments of the fastest pass; speedup = Σ_i B_i / Σ_i r_i·B_i over block segments i, "
    "r_i = median over passes of row_i / base_i of the target-only run interleaved beside the row, B_i = median of "
    "base_i (without interleaving: wall(target-only) / wall(row)); efficiency = speedup / bound "
    "(efficiency_segment / _median_wall / _min_wall: with the ratio of segment-minimum / median / fastest whole-run "
    "walls); call_slowdown = predicted with the row's own medians / predicted; "
    "overhead = 1 − |union of traced call intervals| / wall"
)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def row_basics(v, runs: list[RunMeasure], pattern, models, s, result) -> dict:
    """A row's own figures: acceptance and pattern, walls, phases, call counts against the analytic model, memory."""
    first = runs[0]
    drafted = [r for r in result.blocks if r.drafted]
    accepted = sum(1 for r in drafted if r.decision == "accept")
    consistent = all(r.counts == first.counts and r.decisions == first.decisions for r in runs)
    realized = [r.decision == "accept" for r in drafted if r.block >= 1]
    model_calls = None
    if not v.pipelined and v.router in ("random", "scored"):
        policy = CacheConfig(v.regime, window_frames=s.window, sink_frames=s.sinks).policy()
        model_calls = pattern_counts(realized, steps=[len(x) for x in result.settings["schedule"]], policy=policy,
                                     scored=v.router == "scored", refine_from_step=v.refine_from_step,
                                     cascade=bool(v.cascade))
    latent_hw = (s.height // 8, s.width // 8)
    kv = {}
    for name in ("target", "drafter"):
        model = getattr(models, name)
        used = v.router != ("draft-only" if name == "target" else "target-only")
        if model is not None and used:
            kv[name] = kv_bytes_for(model, v.regime, s.blocks * 3, latent_hw, s.window, s.sinks)
    return {
        "name": v.name, "group": v.group, "router": v.router, "level": v.level, "regime": v.regime,
        "schedule": v.schedule, "pipelined": v.pipelined, "refine_from_step": v.refine_from_step,
        "cascade": v.cascade, "stitch": v.stitch,
        "pattern_expected": list(pattern) if pattern is not None else None,
        "pattern_realized": realized if v.level is not None else None,
        "pattern_ok": (list(pattern) == realized) if pattern is not None else None,
        "acceptance": (accepted / len(drafted)) if drafted else None,
        "accepted": accepted, "drafted": len(drafted),
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


def _memory_fields(passes, name: str) -> dict:
    if name in passes.peaks:
        return {"peak_rss_bytes": max(passes.peaks[name]), "peak_measured": "alone",
                "cuda_peak_bytes": max(passes.cuda_peaks[name]) if name in passes.cuda_peaks else None}
    return {"peak_rss_bytes": passes.group_peaks.get(name), "cuda_peak_bytes": None,
            "peak_measured": "with its interleaved group"}


def _pairing_fields(passes, name: str) -> dict:
    paired = passes.paired[name]
    if not paired:
        return {"paired_base_segments_s": None, "paired_speedups": None}
    runs = passes.measured[name]
    return {"paired_base_segments_s": paired,
            "paired_speedups": [sum(b) / m.wall for b, m in zip(paired, runs, strict=True)]}


def _cost_tables(passes) -> tuple[CostModel, dict[str, CostModel]]:
    by_regime: dict[str, list[RunMeasure]] = {}
    for v in passes.variants:
        more = passes.more_base_runs if v is passes.base else []
        by_regime.setdefault(v.regime, []).extend([*passes.measured[v.name], *more])
    pooled = CostModel.from_runs([r for runs in by_regime.values() for r in runs])
    return pooled, {reg: CostModel.from_runs(runs).with_fallback(pooled) for reg, runs in by_regime.items()}


def _speedups(row: dict, base: dict, runs: list[RunMeasure], table: CostModel, base_pred: float) -> None:
    pred = table.predict(runs[0].calls)
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
    row["call_slowdown"] = CostModel.from_runs(runs).predict(runs[0].calls) / pred if pred > 0 else None


def finish_report(passes, extra: dict) -> dict:
    """Rows with their bounds, speedups and efficiencies, the cost tables, the machine and the goals."""
    s, models = passes.s, passes.models
    rows = []
    for v in passes.variants:
        row = row_basics(v, passes.measured[v.name], passes.patterns.get(v.level), models, s, passes.last[v.name])
        rows.append({**row, **_memory_fields(passes, v.name), **_pairing_fields(passes, v.name)})
    pooled, tables = _cost_tables(passes)
    base = rows[passes.variants.index(passes.base)]
    base_pred = tables["recompute"].predict(passes.measured[base["name"]][0].calls)
    for row in rows:
        _speedups(row, base, passes.measured[row["name"]], tables[row["regime"]], base_pred)
    rec = tables.get("recompute", pooled).by_kind
    ratio = rec["target"] / rec["drafter"] if rec.get("target") and rec.get("drafter") else None
    report = {
        "schema": SCHEMA,
        "settings": {**asdict(s), "interleave": s.groups_of, "levels": list(s.levels), "only": list(s.only),
                     "order": "shuffled per pass"},
        "machine": machine(passes.device),
        "cost_model": {
            "definition": COST_MODEL_DEFINITION,
            "per_call_s": {reg: t.by_kind for reg, t in tables.items()}, "pooled_per_call_s": pooled.by_kind,
            "per_signature_s": {reg: t.as_json() for reg, t in tables.items()},
            "target_over_drafter_forward": ratio,
        },
        "rows": rows,
        **extra,
    }
    report["goals"] = evaluate_goals(report)
    return report


def machine(device: torch.device) -> dict:
    info = {
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ---------------------------------------------------------------------------------------------------------- goals


def steady_start(regime: str, schedule: str, window: int = CacheConfig.window_frames) -> int:
    """First block whose per-block work no longer changes by design: block 1 (recompute/global), the first block
    with a full rolling window (noisy), and not before block 2 under the diagonal schedule (fewer steps later)."""
    start = 1
    if regime == "noisy":
        start = max(start, math.ceil(window / 3))
    if schedule == "diagonal":
        start = max(start, 2)
    return start


def per_block_growth(per_block: Sequence[float], start: int = 1) -> float | None:
    """mean(second half of the steady blocks) / mean(first half) − 1: 0 means flat. None with fewer than 4 steady
    blocks (a half of one block says nothing about a trend)."""
    xs = list(per_block[start:])
    if len(xs) < 4:
        return None
    k = len(xs) // 2
    first, last = statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])
    return last / first - 1.0 if first > 0 else None


def _pipelined_gains(rows: list[dict]) -> dict:
    pipe = {}
    for r in rows:
        if r["group"] != "pipelined" or r["level"] is None:
            continue
        plain = next((p for p in rows if p["group"] == "scored" and p["level"] == r["level"]), None)
        if plain is None:
            continue
        # the same estimator as the efficiency: both speedups are against the baseline (paired when interleaved), so
        # pipelined / plain − 1 is the gain; the walls are shown beside it
        paired = r.get("speedup") and plain.get("speedup")
        pipe[f"{round(r['level'] * 100)}%"] = {
            "plain_s": plain["wall_s"], "pipelined_s": r["wall_s"],
            "plain_speedup": plain.get("speedup"), "pipelined_speedup": r.get("speedup"),
            "gain": (r["speedup"] / plain["speedup"] if paired else plain["wall_s"] / r["wall_s"]) - 1.0,
            "gain_from_walls": plain["wall_s"] / r["wall_s"] - 1.0,
        }
    return pipe


def evaluate_goals(report: dict) -> dict:
    """The issue's goals, checked on this run's numbers."""
    rows = report["rows"]
    sweep = [r for r in rows if r["group"] in ("random", "scored")]
    eff = [r["efficiency"] for r in sweep if r["efficiency"] is not None]
    cross = {key: [r[key] for r in sweep if r.get(key) is not None]
             for key in ("efficiency_segment", "efficiency_median_wall", "efficiency_min_wall")}
    ovh = [r["overhead"] for r in rows if r["overhead"] is not None]
    window = report.get("settings", {}).get("window", CacheConfig.window_frames)
    flat = {f"{r['regime']}/{r['schedule']}": per_block_growth(r["per_block_s"], steady_start(r["regime"], r["schedule"], window))
            for r in rows if r["router"] == "target-only"}
    pipe = _pipelined_gains(rows)
    hi = [v for k, v in pipe.items() if int(k[:-1]) >= 75]
    flat_keys = [k for k in flat if k.startswith(("recompute", "noisy")) and flat[k] is not None]
    return {
        "efficiency_min": min(eff) if eff else None,
        "efficiency_ok": bool(eff) and min(eff) >= GOAL_EFFICIENCY,
        # the same sweep with the unpaired walls (segment minimum, median, fastest whole run): how much the estimator
        # matters on this machine
        **{f"{key}_min": (min(v) if v else None) for key, v in cross.items()},
        "overhead_max": max(ovh) if ovh else None,
        "overhead_ok": bool(ovh) and max(ovh) <= GOAL_OVERHEAD,
        "per_block_growth": flat,
        "flat_ok": all(abs(flat[k]) <= GOAL_FLAT_GROWTH for k in flat_keys) if flat_keys else None,
        "pipelined": pipe,
        "pipelined_ok": all(p["gain"] > 0 for p in hi) if hi else None,
    }


# ---------------------------------------------------------------------------------------------------------- output


def _fmt_pct(x) -> str:
    return "   —" if x is None else f"{x * 100:4.0f}%"


def _f(x, spec: str, width: int) -> str:
    return f"{'—':>{width}}" if x is None else f"{x:{width}{spec}}"


def _table_row(r: dict) -> str:
    ph = r["phase_s"]
    return (
        f"{r['name']:26s} {_fmt_pct(r['acceptance']):>5s} {_f(r['wall_s'], '.3f', 7)} {_f(r['speedup'], '.2f', 6)}× "
        f"{_f(r['bound'], '.2f', 5)}× {_f(r['efficiency'], '.2f', 5)} {_f(r.get('efficiency_segment'), '.2f', 5)} "
        f"{_f((r['overhead'] or 0) * 100, '.1f', 4)}% {_f(r.get('call_slowdown'), '.2f', 5)} "
        + " ".join(_f(ph.get(p), ".3f", 6) for p in ("draft", "decode", "score", "target", "cache", "verify_wait"))
        + f" {_f((r['peak_rss_bytes'] or 0) / 2**20, '.0f', 7)}"
    )


def _goal_lines(g: dict) -> list[str]:
    lines = [
        f"goals: efficiency min {_f(g['efficiency_min'], '.3f', 0)} (≥ {GOAL_EFFICIENCY}: {g['efficiency_ok']}; "
        f"eff/s min {_f(g.get('efficiency_segment_min'), '.3f', 0)}, from median walls "
        f"{_f(g.get('efficiency_median_wall_min'), '.3f', 0)}); "
        f"overhead max {_f((g['overhead_max'] or 0) * 100, '.2f', 0)}% (≤ {GOAL_OVERHEAD * 100:.0f}%: {g['overhead_ok']}); "
        f"flat per-block {g['flat_ok']}; pipelined faster at ≥75%: {g['pipelined_ok']}",
        "per-block time growth over the steady blocks, 2nd half vs 1st half (target-only): "
        + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in g["per_block_growth"].items() if v is not None),
    ]
    if g["pipelined"]:
        lines.append("pipelined vs plain (speedup; walls): " + ", ".join(
            f"{k} {_f(p.get('plain_speedup'), '.2f', 0)}× → {_f(p.get('pipelined_speedup'), '.2f', 0)}× "
            f"({p['gain'] * 100:+.1f}%; {p['plain_s']:.3f}s → {p['pipelined_s']:.3f}s)" for k, p in g["pipelined"].items()))
    return lines


def format_table(report: dict) -> str:
    head = (f"{'variant':26s} {'acc':>5s} {'wall s':>7s} {'speedup':>7s} {'bound':>6s} {'eff':>5s} {'eff/s':>5s} "
            f"{'ovh':>5s} {'slow':>5s} {'draft':>6s} {'decode':>6s} {'score':>6s} {'target':>6s} {'cache':>6s} "
            f"{'wait':>6s} {'rss MB':>7s}")
    lines = [head, "-" * len(head), *(_table_row(r) for r in report["rows"]), ""]
    cm = report["cost_model"]
    rec = cm["per_call_s"].get("recompute", cm["pooled_per_call_s"])
    est = next((r.get("speedup_estimator") for r in report["rows"] if r.get("paired_speedups")), "segment minimum")
    lines.append(f"speedup: {est}; wall s: Σ over block segments of the fastest pass; "
                 "eff/s: efficiency from the ratio of those walls")
    lines.append("per-call median (recompute): " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in rec.items() if v))
    ratio = cm["target_over_drafter_forward"]
    lines.append(f"target/drafter forward cost ratio: {ratio:.1f}×" if ratio else "target/drafter ratio: n/a")
    if rec.get("target"):
        lines.append("per-call cost / a target forward: " + ", ".join(
            f"{k} {rec[k] / rec['target']:.3f}" for k in ("drafter", "decode", "score", "encode") if rec.get(k)))
    lines += _goal_lines(report["goals"])
    m = report["machine"]
    lines.append(f"machine: {m['device']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['torch_threads']} intra-op thread(s)")
    return "\n".join(lines)


PLOT_COLORS = {"random": (46, 120, 200), "scored": (219, 109, 40), "pipelined": (46, 160, 67)}


def render_plot(report: dict, path: str | Path, *, width: int = 820, height: int = 520) -> Path:
    """Speedup vs acceptance: measured points per group, the cost-model bound as a dashed line beside them."""
    from ..outputs.plotting import Chart, linspace

    rows = [r for r in report["rows"] if r["level"] is not None and r["group"] in PLOT_COLORS]
    right = width - 190
    chart = Chart(width, height, (70, 40, right, height - 60),
                  title="SDVG bench: speedup over target-only (points) vs cost-model bound (dashed)")
    ys = [r["speedup"] for r in rows if r["speedup"]] + [r["bound"] for r in rows if r["bound"]] + [1.0]
    chart.set_range((0.0, 1.0), (min(0.0, min(ys)), max(ys) * 1.1))
    chart.x_ticks(linspace(0.0, 1.0, 5), lambda v: f"{int(v * 100)}%", label="acceptance of drafted blocks")
    chart.y_ticks(linspace(*chart.y_range, 7), lambda v: f"{v:.2f}x")
    chart.frame()
    chart.line([(0.0, 1.0), (1.0, 1.0)], (150, 150, 150), width=1)
    legend = []
    for group, color in PLOT_COLORS.items():
        pts = sorted((r["level"], r["speedup"], r["bound"]) for r in rows if r["group"] == group and r["speedup"])
        if not pts:
            continue
        chart.line([(lv, b) for lv, _, b in pts if b], color, dashed=True)
        chart.line([(lv, sp) for lv, sp, _ in pts], color)
        for lv, sp, b in pts:
            chart.marker(lv, sp, color)
            if b:
                chart.marker(lv, b, color, shape="square", size=3)
        legend += [(f"{group} (measured)", color, "dot"), (f"{group} (bound)", color, "square")]
    chart.legend((right + 15, 40), legend, step=19)
    return chart.save(path)
