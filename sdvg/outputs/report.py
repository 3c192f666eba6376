"""Human-readable views of a generation report: a text summary and a timeline chart (PIL only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image

from ..jsonable import from_json_float, to_jsonable
from .files import write_atomic
from .plotting import Chart, nice_range

COLORS = {
    "accept": (46, 160, 67),  # draft accepted
    "reject": (219, 109, 40),  # target regenerated after a rejected draft
    "forced": (70, 110, 200),  # target without a draft (block 0, target-only)
    "input": (140, 140, 150),  # a given block (image-to-video, extension)
    "tau": (200, 40, 40),
    "text": (30, 30, 30),
    "grid": (215, 215, 215),
    "bg": (255, 255, 255),
}


def block_kind(block: dict) -> str:
    """'accept' (draft kept), 'reject' (draft rejected, target regenerated), 'forced' (target, no draft) or 'input'
    (a given block)."""
    if block.get("produced_by") == "input":
        return "input"
    if block.get("produced_by") == "drafter":
        return "accept"
    return "reject" if block.get("drafted") else "forced"


def _threshold_text(router: dict) -> str:
    """The threshold setting that is in force for the router's threshold mode."""
    mode = router.get("threshold")
    if mode == "relative":
        return f"δ={router.get('delta')} below block 0's score"
    if mode == "target-rate":
        return f"target rate {router.get('target_rate')}"
    return f"τ={router.get('tau')}"


def summarize(report: dict, *, blocks: bool = True) -> str:
    """A few readable lines: settings, acceptance, speed and (``blocks``) one line per block (:func:`block_line`)."""
    s, t = report.get("settings", {}), report.get("totals", {})
    router = s.get("router", {})
    lines = [
        f"SDVG {'(partial) ' if report.get('partial') else ''}— {t.get('blocks', 0)}/{s.get('num_blocks', '?')} blocks, "
        f"{s.get('width')}×{s.get('height')}, seed {s.get('seed')}, cache {s.get('cache')}",
        f"router: {router.get('mode')} {_threshold_text(router)} {router.get('aggregation')} "
        f"({router.get('threshold')} threshold)",
    ]
    acc = t.get("acceptance")
    lines.append(
        f"accepted drafts: {t.get('accepted', 0)}/{t.get('drafted', 0)}"
        + (f" ({acc:.0%})" if acc is not None else "")
        + f"; wall {t.get('wall_s', 0):.2f}s"
        + (f"; est. target-only {t['est_target_only_s']:.2f}s" if t.get("est_target_only_s") else "")
        + (f"; speedup ≈ {t['speedup_est']:.2f}×" if t.get("speedup_est") else "")
    )
    if blocks:
        lines += [block_line(b) for b in report.get("blocks", [])]
    return "\n".join(lines)


def block_line(b: dict) -> str:
    """One block of a report (a ``BlockRecord.to_dict()``): outcome, model, q, reason and timings (and the prompt
    line before it where a prompt timeline switches)."""
    q = from_json_float(b.get("q"))
    qtxt = f"q={q:+.3f}" if q is not None and math.isfinite(q) else "q=—"
    timing = ", ".join(f"{k} {v * 1000:.0f}ms" for k, v in b.get("timings", {}).items() if v >= 0.0005)
    head = f"  -- prompt from block {b['block']}: {b['prompt']}\n" if b.get("prompt") else ""
    return f"{head}  block {b['block']}: {block_kind(b):7s} by {b['produced_by']:7s} {qtxt}  {b['reason']}  [{timing}]"


def render_timeline(report: dict, *, width: int = 900, height: int = 300) -> Image.Image:
    """One cell per block coloured by outcome, q_b dots against the τ line, and a legend."""
    blocks = report.get("blocks", [])
    n = max(1, int(report.get("settings", {}).get("num_blocks") or len(blocks) or 1))
    left, right, top, cells_h = 50, width - 20, 28, 34
    chart = Chart(width, height, (left, 80, right, height - 40))
    chart.text((left, 6), "SDVG timeline")
    cell_w = (right - left) / n
    for i in range(n):
        x0, x1 = left + i * cell_w + 2, left + (i + 1) * cell_w - 2
        block = next((b for b in blocks if b.get("block") == i), None)
        chart.draw.rectangle([x0, top, x1, top + cells_h], fill=COLORS[block_kind(block)] if block else COLORS["grid"])
        chart.text((x0 + 4, top + 10), str(i), (255, 255, 255) if block else COLORS["text"])
    qs = [from_json_float(b.get("q")) for b in blocks]
    taus = [from_json_float(b.get("tau")) for b in blocks]
    lo, hi = nice_range(qs + taus)
    chart.set_range((0.0, float(n)), (lo, hi))
    chart.frame(COLORS["grid"])
    pad = (hi - lo) / 12  # the ticks sit at the data's own extremes, inside the padding
    chart.y_ticks([lo + pad, hi - pad], lambda v: f"{v:+.2f}", grid=False)
    for i, (q, tau) in enumerate(zip(qs, taus, strict=False)):
        if tau is not None and math.isfinite(tau):
            chart.line([(i, tau), (i + 1, tau)], COLORS["tau"])
        if q is not None and math.isfinite(q):
            chart.marker(i + 0.5, q, COLORS[block_kind(blocks[i])], size=5)
    for b in blocks:  # a prompt timeline: a dashed line where each new prompt starts
        if b.get("prompt"):
            i = int(b["block"])
            chart.line([(i, lo), (i, hi)], COLORS["text"], width=1, dashed=True)
            chart.draw.line([left + i * cell_w, top - 4, left + i * cell_w, top + cells_h + 4], fill=COLORS["text"],
                            width=2)
    legend = [("draft accepted", COLORS["accept"], "box"), ("target regenerated", COLORS["reject"], "box"),
              ("target (forced)", COLORS["forced"], "box"), ("tau in force", COLORS["tau"], "line")]
    chart.legend((left, height - 26), legend, horizontal=150)
    return chart.image


def write_report(report: dict, path: str | Path) -> Path:
    """The report as strict JSON, written atomically."""
    text = json.dumps(to_jsonable(report), indent=2, allow_nan=False)
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_timeline(report: dict, path: str | Path) -> Path:
    """The timeline chart as PNG, written atomically."""
    return write_atomic(path, render_timeline(report).save)
