"""What ``generate`` says while it runs: a fixed-width progress bar with the rate and ETA on stderr, and one line per
finished block on stdout, flushed as the block finishes (so a log or a pipe shows a long run as it goes).

The bar is :data:`BAR_WIDTH` characters whatever the block count (a million-block run writes lines as short as a
seven-block one); the rate is blocks per second over the run so far, the ETA the blocks left at that rate.
"""

from __future__ import annotations

import math
import sys
import time

BAR_WIDTH = 30


def format_duration(seconds: float) -> str:
    """``42s``, ``12m05s``, ``3h07m``, ``12d04h`` (never wider than 6 characters for under 100 days)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[######........]``: ``width`` characters inside the brackets for any ``total``."""
    filled = width if total <= 0 else min(width, done * width // total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def rate_text(done: int, total: int, elapsed: float) -> str:
    """``0.52 blocks/s, 1m10s elapsed, ~3m12s left`` (the ETA: the blocks left at the rate so far)."""
    rate = done / elapsed if elapsed > 0 else float("inf")
    left = (total - done) / rate if done and math.isfinite(rate) and rate > 0 else float("nan")
    rate_txt = f"{rate:.3g} blocks/s" if math.isfinite(rate) else "- blocks/s"
    return f"{rate_txt}, {format_duration(elapsed)} elapsed, ~{format_duration(left) if done < total else '0s'} left"


class Progress:
    """stderr: the bar and ETA per block (redrawn per denoising step on a terminal); stdout: one line per block,
    flushed at once. ``block_line(record)`` turns a finished block's record into its stdout line."""

    def __init__(self, total: int, block_line, *, stream=None, out=None, clock=time.perf_counter):
        # sys.stderr/stdout looked up now, not at import (a test's captured stream may be closed by then)
        self.stream = sys.stderr if stream is None else stream
        self.out = sys.stdout if out is None else out
        self.total, self.block_line, self.clock = total, block_line, clock
        self.start = clock()
        self.live = self.stream.isatty()

    def step(self, ev) -> None:
        if not self.live:
            return
        self.stream.write(f"\r  block {ev.block + 1}/{self.total}  {ev.model:7s} step {ev.step + 1}/{ev.num_steps}   ")
        self.stream.flush()

    def block(self, ev) -> None:
        done = ev.block + 1
        elapsed = self.clock() - self.start
        self.out.write(self.block_line(ev.record.to_dict()) + "\n")
        self.out.flush()
        self.stream.write(f"{chr(13) if self.live else ''}{progress_bar(done, self.total)} {done}/{self.total}  "
                          f"{rate_text(done, self.total, elapsed)}\n")
        self.stream.flush()
