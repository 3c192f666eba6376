"""Human-readable views of a generation report: a text summary and a timeline chart (PIL only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLORS = {
    "accept": (46, 160, 67),  # draft accepted
    "reject": (219, 109, 40),  # target regenerated after a rejected draft
    "forced": (70, 110, 200),  # target without a draft (block 0, target-only)
    "tau": (200, 40, 40),
    "text": (30, 30, 30),
    "grid": (215, 215, 215),
    "bg": (255, 255, 255),
}


def _num(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}.get(value)
    return float(value)


def block_kind(block: dict) -> str:
    """'accept' (draft kept), 'reject' (draft rejected, target regenerated) or 'forced' (target, no draft)."""
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


def summarize(report: dict) -> str:
    """A few readable lines: settings, acceptance, speed and one line per block."""
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
    for b in report.get("blocks", []):
        q = _num(b.get("q"))
        qtxt = f"q={q:+.3f}" if q is not None and math.isfinite(q) else "q=—"
        timing = ", ".join(f"{k} {v * 1000:.0f}ms" for k, v in b.get("timings", {}).items() if v >= 0.0005)
        lines.append(f"  block {b['block']}: {block_kind(b):7s} by {b['produced_by']:7s} {qtxt}  {b['reason']}  [{timing}]")
    return "\n".join(lines)


def render_timeline(report: dict, *, width: int = 900, height: int = 300) -> Image.Image:
    """One cell per block coloured by outcome, q_b dots against the τ line, and a legend."""
    img = Image.new("RGB", (width, height), COLORS["bg"])
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    blocks = report.get("blocks", [])
    n = max(1, int(report.get("settings", {}).get("num_blocks") or len(blocks) or 1))
    left, right, top, cells_h, plot_top, bottom = 50, width - 20, 28, 34, 80, height - 40
    cell_w = (right - left) / n
    draw.text((left, 6), "SDVG timeline", fill=COLORS["text"], font=font)
    for i in range(n):
        x0, x1 = left + i * cell_w + 2, left + (i + 1) * cell_w - 2
        block = next((b for b in blocks if b.get("block") == i), None)
        fill = COLORS[block_kind(block)] if block else COLORS["grid"]
        draw.rectangle([x0, top, x1, top + cells_h], fill=fill)
        draw.text((x0 + 4, top + 10), str(i), fill=(255, 255, 255) if block else COLORS["text"], font=font)
    qs = [_num(b.get("q")) for b in blocks]
    taus = [_num(b.get("tau")) for b in blocks]
    finite = [v for v in qs + taus if v is not None and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (-1.0, 1.0)
    if hi - lo < 1e-6:
        lo, hi = lo - 1.0, hi + 1.0
    pad = 0.1 * (hi - lo)
    lo, hi = lo - pad, hi + pad

    def y_of(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * (bottom - plot_top)

    draw.rectangle([left, plot_top, right, bottom], outline=COLORS["grid"])
    for v in (lo + pad, hi - pad):
        draw.text((4, y_of(v) - 6), f"{v:+.2f}", fill=COLORS["text"], font=font)
    for i, (q, tau) in enumerate(zip(qs, taus, strict=False)):
        cx0, cx1 = left + i * cell_w, left + (i + 1) * cell_w
        if tau is not None and math.isfinite(tau):
            draw.line([cx0, y_of(tau), cx1, y_of(tau)], fill=COLORS["tau"], width=2)
        if q is not None and math.isfinite(q):
            cx, cy = (cx0 + cx1) / 2, y_of(q)
            draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=COLORS[block_kind(blocks[i])])
    legend = [("draft accepted", "accept"), ("target regenerated", "reject"), ("target (forced)", "forced")]
    x = left
    for label, key in legend:
        draw.rectangle([x, height - 26, x + 12, height - 14], fill=COLORS[key])
        draw.text((x + 16, height - 26), label, fill=COLORS["text"], font=font)
        x += 150
    draw.line([x, height - 20, x + 14, height - 20], fill=COLORS["tau"], width=2)
    draw.text((x + 18, height - 26), "τ in force" if _ascii_ok(font) else "tau", fill=COLORS["text"], font=font)
    return img


def _ascii_ok(font) -> bool:
    try:
        font.getbbox("τ")
        return True
    except Exception:  # noqa: BLE001 - the default bitmap font may not carry the glyph
        return False


def write_report(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False), encoding="utf-8")
    return path
