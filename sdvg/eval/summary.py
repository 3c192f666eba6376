"""``sdvg eval``'s summary: per (method, τ) means with bootstrap 95 % intervals over prompts, the Pareto front, the
summary CSV, the printed table and the Pareto plot. Reads the results rows (strings, as the CSV holds them)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..outputs.files import write_atomic
from .stats import bootstrap_ci, mean_or_none

METRIC_PREFIX = "m_"
# a world judge's metrics (``sdvg.toy.judge.judge_metric``: m_judge, m_judge_all, ...) are summarized without the
# prefix (judge, judge_lo, judge_hi, ...) and judge is then the quality axis of the Pareto front
JUDGE = "judge"
QUALITY = ("ir_mean", "ir_min", "ir_retention", "ir_delta")  # per-prompt columns averaged (and bootstrapped)
METHOD_ORDER = {"target-only": 0, "draft-only": 1, "target0-draft": 2, "sdvg": 3, "random": 4, "refine": 5,
                "sdvg-rate": 6, "random-rate": 7}


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(round(value, 6))
    return str(value)


def num(text: str | None) -> float | None:
    try:
        return None if text in (None, "") else float(text)
    except ValueError:
        return None


def _speedup(pairs: Sequence[tuple[float, float]]) -> float | None:
    walls = sum(w for w, _ in pairs)
    return sum(r for _, r in pairs) / walls if walls > 0 else None


def summarize(rows: Sequence[Mapping[str, str]], *, seed: int = 0) -> list[dict]:
    """Per (method, τ): prompts, speedup (Σ target-only wall / Σ wall over the same prompts), mean acceptance, means
    of the per-prompt quality columns (IR mean / min, retention, delta, external metrics), each with its bootstrap
    95 % interval over prompts (``<column>_lo`` / ``_hi``; ``random.Random(seed)``), and whether the point is on the
    Pareto front."""
    ref = {r["prompt_id"]: r for r in rows if r["method"] == "target-only"}
    groups: dict[tuple[str, str], list[Mapping[str, str]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["tau"]), []).append(r)
    out = []
    for (method, tau), rs in groups.items():
        rs = [r for r in rs if r["prompt_id"] in ref]
        if not rs:
            continue
        pairs = [(num(r["wall_s"]) or 0.0, num(ref[r["prompt_id"]]["wall_s"]) or 0.0) for r in rs]
        accs = [a for a in (num(r["acceptance"]) for r in rs) if a is not None]
        item = {"method": method, "tau": tau, "prompts": len(rs), "speedup": _speedup(pairs),
                "acceptance": statistics.fmean(accs) if accs else None}
        item["speedup_lo"], item["speedup_hi"] = bootstrap_ci(pairs, _speedup, seed=seed) or (None, None)
        # the projection at the real pair's per-call costs (real_cost.py): Σ target-only T MACs / Σ the row's
        macs = [(num(r.get("real_tmacs")), num(ref[r["prompt_id"]].get("real_tmacs"))) for r in rs]
        macs = [(a, b) for a, b in macs if a is not None and b is not None]
        item["speedup_real"] = _speedup(macs) if macs else None
        item["speedup_real_lo"], item["speedup_real_hi"] = (bootstrap_ci(macs, _speedup, seed=seed)
                                                            if macs else None) or (None, None)
        metric_cols = sorted({k for r in rs for k in r if k.startswith(METRIC_PREFIX)})
        for c in (*QUALITY, *metric_cols):
            vals = [num(r.get(c)) for r in rs]
            name = c[len(METRIC_PREFIX):] if c.startswith(METRIC_PREFIX + JUDGE) else c
            item[name] = mean_or_none(vals)
            item[name + "_lo"], item[name + "_hi"] = bootstrap_ci(vals, mean_or_none, seed=seed) or (None, None)
        out.append(item)
    q = quality_column(out)
    for item in out:
        item["pareto"] = not any(
            o is not item and o["speedup"] is not None and item["speedup"] is not None
            and o["speedup"] >= item["speedup"] and o[q] >= item[q]
            and (o["speedup"] > item["speedup"] or o[q] > item[q])
            for o in out
        )
    out.sort(key=lambda x: (METHOD_ORDER.get(x["method"], 9), num(x["tau"]) or 0.0))
    return out


def quality_column(summary: Sequence[Mapping]) -> str:
    """The quality axis: the world judge's caption accuracy when it was measured, else the mean ImageReward."""
    return JUDGE if summary and all(s.get(JUDGE) is not None for s in summary) else "ir_mean"


def _is_metric(name: str) -> bool:
    return name.startswith((METRIC_PREFIX, JUDGE)) and not name.endswith(("_lo", "_hi"))


def _with_ci(names: Sequence[str]) -> list[str]:
    return [c for name in names for c in (name, name + "_lo", name + "_hi")]


def write_summary(summary: Sequence[dict], path: Path) -> Path:
    metrics = sorted({k for s in summary for k in s if _is_metric(k)}, key=lambda k: (not k.startswith(JUDGE), k))
    cols = ["method", "tau", "prompts", *_with_ci(["speedup", "speedup_real"]), "acceptance", *_with_ci([*metrics[:1], *QUALITY,
                                                                                        *metrics[1:]]), "pareto"]

    return write_csv(summary, cols, path)


def write_csv(rows: Sequence[Mapping], cols: Sequence[str], path: Path) -> Path:
    """``rows`` as a CSV of ``cols`` (each value through :func:`cell`), written atomically."""
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(cols), lineterminator="\n", extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow({c: cell(row.get(c)) for c in cols})

    return write_atomic(path, write)


PARETO_COLORS = {"target-only": (70, 110, 200), "draft-only": (120, 120, 120), "target0-draft": (150, 90, 180),
                 "sdvg": (219, 109, 40), "random": (46, 160, 67), "refine": (30, 160, 170),
                 "sdvg-rate": (190, 60, 20), "random-rate": (90, 190, 90)}
FRONT_COLOR = (200, 40, 40)


def render_pareto(summary: Sequence[dict], path: Path, *, width: int = 820, height: int = 520) -> Path:
    """Quality (the judge's caption accuracy when measured, else the mean ImageReward of the outputs) vs speedup per
    method/τ, with the quality's 95 % interval as a vertical bar; the Pareto front is connected."""
    from ..outputs.plotting import BLACK, Chart, linspace, nice_range

    right = width - 170
    q = quality_column(summary)
    what = "judge caption accuracy" if q == JUDGE else "mean ImageReward of the output"
    chart = Chart(width, height, (80, 40, right, height - 60),
                  title=f"SDVG eval: {what} vs speedup over target-only (Pareto front: line)")
    pts = [s for s in summary if s["speedup"] is not None]
    if not pts:
        chart.frame()
        return chart.save(path)
    xs = [p["speedup"] for p in pts]
    bounds = [v for p in pts for v in (p[q], p.get(q + "_lo"), p.get(q + "_hi")) if v is not None]
    chart.set_range((min(xs + [1.0]) * 0.95, max(xs) * 1.05), nice_range(bounds))
    chart.x_ticks(linspace(*chart.x_range, 6), lambda v: f"{v:.2f}", label="speedup over target-only (x)")
    chart.y_ticks(linspace(*chart.y_range, 6), lambda v: f"{v:+.3f}")
    chart.frame()
    front = sorted((p for p in pts if p["pareto"]), key=lambda p: p["speedup"])
    chart.line([(p["speedup"], p[q]) for p in front], FRONT_COLOR)
    for p in pts:
        color = PARETO_COLORS.get(p["method"], BLACK)
        if p.get(q + "_lo") is not None and p.get(q + "_hi") is not None:
            chart.line([(p["speedup"], p[q + "_lo"]), (p["speedup"], p[q + "_hi"])], color)
        chart.marker(p["speedup"], p[q], color, size=5, outline=BLACK if p["pareto"] else None)
        x, y = chart.px(p["speedup"], p[q])
        chart.text((x + 7, y - 6), p["method"] if not p["tau"] else f"{p['method']} tau={p['tau']}", (60, 60, 60))
    legend = [(m, c, "dot") for m, c in PARETO_COLORS.items()] + [("Pareto front", FRONT_COLOR, "line")]
    chart.legend((right + 12, 40), legend)
    return chart.save(path)


def _interval(s: dict, name: str, fmt: str) -> str:
    lo, hi = s.get(name + "_lo"), s.get(name + "_hi")
    return "—" if lo is None or hi is None else f"[{lo:{fmt}}, {hi:{fmt}}]"


def format_summary(summary: Sequence[dict]) -> str:
    judged = quality_column(summary) == JUDGE
    head = (f"{'method':13s} {'τ':>6s} {'n':>3s} {'speedup':>8s} {'95% CI':>14s} {'real':>6s} {'accept':>7s} {'IR mean':>8s} "
            f"{'95% CI':>17s} {'IR min':>8s} {'retain':>7s}" + (f" {'judge':>6s} {'95% CI':>14s}" if judged else "")
            + " pareto")
    lines = [head, "-" * len(head)]
    for s in summary:
        acc = "—" if s["acceptance"] is None else f"{s['acceptance']:.0%}"
        ret = "—" if s["ir_retention"] is None else f"{s['ir_retention']:.1%}"
        sp = "—" if s["speedup"] is None else f"{s['speedup']:.2f}×"
        real = "—" if s.get("speedup_real") is None else f"{s['speedup_real']:.2f}×"
        lines.append(f"{s['method']:13s} {s['tau'] or '—':>6s} {s['prompts']:3d} {sp:>8s} "
                     f"{_interval(s, 'speedup', '.2f'):>14s} {real:>6s} {acc:>7s} {s['ir_mean']:+8.3f} "
                     f"{_interval(s, 'ir_mean', '+.3f'):>17s} {s['ir_min']:+8.3f} {ret:>7s}"
                     + (f" {s[JUDGE]:6.3f} {_interval(s, JUDGE, '.3f'):>14s}" if judged else "")
                     + f" {'*' if s['pareto'] else ''}")
    lines.append("95% CI: bootstrap over prompts (2000 resamples, seeded); random = matched acceptance, block 0 protected;"
                 " real = speedup_real, the counted calls priced at the real pair's MACs (a projection, real_cost.py)")
    return "\n".join(lines)
