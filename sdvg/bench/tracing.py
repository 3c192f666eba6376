"""Tracing a bench run: every model call (through the engine's call hooks), its interval and signature, and what a
run measured (``RunMeasure``). Plus the process's peak memory."""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..sampling.calls import CALL_KINDS, Call

PHASES = ("draft", "decode", "score", "target", "cache", "output", "verify_wait")


class CallTracer:
    """A call observer that records ``(kind, start, end, signature)`` of every call of one run. On CUDA it waits for
    the device before a call starts and after it ends, so a call's interval is its device time."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.events: list[tuple[str, float, float, tuple]] = []
        self._open: dict[int, float] = {}
        self._lock = threading.Lock()

    def sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def call_started(self, call: Call) -> None:
        self.sync()
        with self._lock:
            self._open[id(call)] = time.perf_counter()

    def call_finished(self, call: Call) -> None:
        self.sync()
        end = time.perf_counter()
        with self._lock:
            self.events.append((call.kind, self._open.pop(id(call)), end, call.signature))


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
        out = dict.fromkeys(CALL_KINDS, 0)
        for kind, _sig, _sec in self.calls:
            out[kind] += 1
        return out

    @property
    def call_seconds(self) -> dict[str, float]:
        out = dict.fromkeys(CALL_KINDS, 0.0)
        for kind, _sig, sec in self.calls:
            out[kind] += sec
        return out

    @property
    def in_calls(self) -> float:
        return sum(sec for _kind, _sig, sec in self.calls)

    @classmethod
    def of(cls, result, events: list[tuple[str, float, float, tuple]], segments: list[float]) -> RunMeasure:
        phases = dict.fromkeys(PHASES, 0.0)
        per_block = []
        for r in result.blocks:
            per_block.append(sum(val for k, val in r.timings.items() if k != "verify_wait"))
            for k, val in r.timings.items():
                phases[k] = phases.get(k, 0.0) + val
        return cls(
            wall=sum(segments), busy=busy_seconds([(a, b) for _, a, b, _ in events]), phases=phases,
            per_block=per_block, decisions=[r.decision for r in result.blocks],
            produced_by=[r.produced_by for r in result.blocks], segments=list(segments),
            calls=[(kind, sig, b - a) for kind, a, b, sig in sorted(events, key=lambda e: e[1])],
        )


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
