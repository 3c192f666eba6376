"""One small chart helper for every PNG the project draws (the run timeline, the bench's speedup plot, the eval's
Pareto plot): a plot area with data coordinates, ticks and grid, lines (solid or dashed), markers, text and a
legend. PIL only: no GUI backend, no extra dependency for ComfyUI users."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .files import write_atomic

Color = tuple[int, int, int]
BLACK: Color = (0, 0, 0)
TEXT: Color = (30, 30, 30)
GRID: Color = (230, 230, 230)
WHITE: Color = (255, 255, 255)


class Chart:
    """A ``width × height`` image whose plot area is ``box = (left, top, right, bottom)`` in pixels."""

    def __init__(self, width: int, height: int, box: tuple[int, int, int, int], *, title: str = "") -> None:
        self.image = Image.new("RGB", (width, height), WHITE)
        self.draw = ImageDraw.Draw(self.image)
        self.font = ImageFont.load_default()
        self.box = box
        self.x_range = (0.0, 1.0)
        self.y_range = (0.0, 1.0)
        if title:
            self.text((box[0], 12), title)

    # ---- coordinates -------------------------------------------------------------------------------------------
    def set_range(self, x: tuple[float, float], y: tuple[float, float]) -> None:
        self.x_range = (x[0], x[1] if x[1] > x[0] else x[0] + 1.0)
        self.y_range = (y[0], y[1] if y[1] > y[0] else y[0] + 1.0)

    def px(self, x: float, y: float) -> tuple[float, float]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        left, top, right, bottom = self.box
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    # ---- axes ------------------------------------------------------------------------------------------------
    def frame(self, color: Color = BLACK) -> None:
        self.draw.rectangle(list(self.box), outline=color)

    def x_ticks(self, values: Sequence[float], fmt: Callable[[float], str], *, label: str = "") -> None:
        left, _top, right, bottom = self.box
        for v in values:
            x = self.px(v, self.y_range[0])[0]
            self.draw.line([(x, bottom), (x, bottom + 5)], fill=BLACK)
            self.text((x - 10, bottom + 8), fmt(v))
        if label:
            self.text((left + (right - left) / 2 - 3 * len(label), bottom + 30), label)

    def y_ticks(self, values: Sequence[float], fmt: Callable[[float], str], *, grid: bool = True) -> None:
        left, _top, right, _bottom = self.box
        for v in values:
            y = self.px(self.x_range[0], v)[1]
            self.draw.line([(left - 5, y), (left, y)], fill=BLACK)
            if grid:
                self.draw.line([(left, y), (right, y)], fill=GRID)
            self.text((left - 8 - 6 * len(fmt(v)), y - 6), fmt(v))

    # ---- marks -----------------------------------------------------------------------------------------------
    def line(self, points: Sequence[tuple[float, float]], color: Color, *, width: int = 2, dashed: bool = False,
             data: bool = True) -> None:
        """A polyline through ``points`` (data coordinates, or pixels with ``data=False``)."""
        pts = [self.px(x, y) if data else (x, y) for x, y in points]
        if len(pts) < 2:
            return
        if not dashed:
            self.draw.line(pts, fill=color, width=width)
            return
        for a, b in zip(pts, pts[1:], strict=False):
            self._dashes(a, b, color, width)

    def _dashes(self, a, b, color: Color, width: int, dash: float = 6.0) -> None:
        (x0, y0), (x1, y1) = a, b
        n = max(1, int(math.hypot(x1 - x0, y1 - y0) // dash))
        for i in range(0, n, 2):
            t0, t1 = i / n, min(1.0, (i + 1) / n)
            self.draw.line([(x0 + (x1 - x0) * t0, y0 + (y1 - y0) * t0), (x0 + (x1 - x0) * t1, y0 + (y1 - y0) * t1)],
                           fill=color, width=width)

    def marker(self, x: float, y: float, color: Color, *, shape: str = "dot", size: int = 4,
               outline: Color | None = None, data: bool = True) -> None:
        cx, cy = self.px(x, y) if data else (x, y)
        box = [cx - size, cy - size, cx + size, cy + size]
        if shape == "square":
            self.draw.rectangle(box, outline=color)
        else:
            self.draw.ellipse(box, fill=color, outline=outline or color)

    def text(self, at: tuple[float, float], text: str, color: Color = TEXT) -> None:
        self.draw.text(at, text if self.can_draw(text) else text.encode("ascii", "replace").decode(), fill=color,
                       font=self.font)

    def can_draw(self, text: str) -> bool:
        """Whether the default font has every glyph (the bitmap fallback font is ASCII only)."""
        try:
            self.font.getbbox(text)
            return True
        except Exception:  # noqa: BLE001 - PIL raises various errors for missing glyphs
            return False

    def legend(self, at: tuple[float, float], entries: Sequence[tuple[str, Color, str]], *, step: int = 18,
               horizontal: int = 0) -> None:
        """Entries ``(label, color, shape)``; shape ``dot``, ``square``, ``box`` (filled) or ``line``. Stacked
        vertically, or side by side every ``horizontal`` pixels."""
        x, y = at
        for label, color, shape in entries:
            if shape == "line":
                self.draw.line([(x, y + 6), (x + 14, y + 6)], fill=color, width=2)
            elif shape == "box":
                self.draw.rectangle([x, y, x + 12, y + 12], fill=color)
            else:
                self.marker(x + 6, y + 6, color, shape=shape, size=4 if shape == "dot" else 3, data=False)
            self.text((x + 18, y), label)
            if horizontal:
                x += horizontal
            else:
                y += step

    # ---- output ----------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the PNG atomically (a temporary file renamed): a reader never sees half a chart."""
        return write_atomic(path, self.image.save)


def nice_range(values: Sequence[float], *, pad: float = 0.1, include: Sequence[float] = ()) -> tuple[float, float]:
    """A padded ``(low, high)`` around the finite ``values`` (and ``include``); (-1, 1) when there are none."""
    finite = [v for v in (*values, *include) if v is not None and math.isfinite(v)]
    if not finite:
        return -1.0, 1.0
    lo, hi = min(finite), max(finite)
    if hi - lo < 1e-6:
        lo, hi = lo - 1.0, hi + 1.0
    margin = pad * (hi - lo)
    return lo - margin, hi + margin


def linspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)] if n > 1 else [lo]
