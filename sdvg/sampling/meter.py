"""The run meter: phase timings per block, model-call counts and the run's totals.

It is a call observer (``hooks.py``): it counts every model call and times the re-encodes, and the block loop
asks it to time the phases of each block (draft, decode, score, target, cache, output). A model's seconds are
its denoise phases minus the re-encodes that ran inside them, so the per-forward means stay forward times.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .calls import CALL_KINDS, Call
from .regimes import CachePolicy
from .results import BlockRecord


class RunMeter:
    def __init__(self, models: Sequence[str]) -> None:
        self.models = tuple(models)
        self.started = time.perf_counter()
        self.calls = dict.fromkeys(CALL_KINDS, 0)
        self.encode_seconds = 0.0
        self.model_seconds = dict.fromkeys(self.models, 0.0)
        self._lock = threading.Lock()
        self._open: dict[int, float] = {}
        self._counted = dict.fromkeys(self.models, 0)

    # ---- CallObserver ---------------------------------------------------------------------------------------
    def call_started(self, call: Call) -> None:
        if call.kind == "encode":
            with self._lock:
                self._open[id(call)] = time.perf_counter()

    def call_finished(self, call: Call) -> None:
        with self._lock:
            self.calls[call.kind] = self.calls.get(call.kind, 0) + 1
            if call.kind == "encode":
                self.encode_seconds += time.perf_counter() - self._open.pop(id(call))

    # ---- phases ---------------------------------------------------------------------------------------------
    @staticmethod
    @contextmanager
    def phase(timings: dict[str, float], name: str, device: torch.device | None = None) -> Iterator[None]:
        """Add the wall time of the block to ``timings[name]``. On CUDA it waits for ``device`` first, so GPU time
        lands in the phase that queued it (the router needs scores on the host anyway, so this costs little). An
        exception leaving the block is tagged ``sdvg_stage = name`` (where the fault happened)."""
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            if not hasattr(exc, "sdvg_stage"):  # the innermost phase names where a fault happened
                with contextlib.suppress(AttributeError):
                    exc.sdvg_stage = name
            raise
        finally:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

    @contextmanager
    def denoise(self, model: str, timings: dict[str, float], device: torch.device | None) -> Iterator[None]:
        """A model's denoise: the draft / target phase, and its seconds without the re-encodes inside it."""
        start, encoding = time.perf_counter(), self.encode_seconds
        try:
            with self.phase(timings, "draft" if model == "drafter" else "target", device):
                yield
        finally:
            self.model_seconds[model] += time.perf_counter() - start - (self.encode_seconds - encoding)

    def block_forwards(self) -> dict[str, int]:
        """Forwards of each model since the previous call (a block's share, speculative drafts included)."""
        out = {}
        for name in self.models:
            out[name] = self.calls[name] - self._counted[name]
            self._counted[name] = self.calls[name]
        return out

    def call_stats(self) -> dict[str, dict[str, float]]:
        stats = {name: {"seconds": self.model_seconds[name], "calls": self.calls[name]} for name in self.models}
        stats["encode"] = {"seconds": self.encode_seconds, "calls": self.calls["encode"]}
        return stats

    def totals(self, records: list[BlockRecord], policy: CachePolicy, planned_blocks: int,
               target_steps: list[int] | None = None) -> dict:
        return estimate_totals(records, time.perf_counter() - self.started, self.call_stats(), policy, planned_blocks,
                               target_steps)


def estimate_totals(records: list[BlockRecord], wall: float, call_stats: dict, policy: CachePolicy,
                    planned_blocks: int, target_steps: list[int] | None = None) -> dict:
    """Acceptance, wall time, and the target-only time estimated from this run's measured per-call times.

    Cost model: a target-only block costs (steps + the regime's cache forwards) × the mean target forward time + one
    decode, plus the regime's context re-encodes (recompute with Krea's first frame: one per block from block 2).
    ``target_steps``: the target's steps for each block (its schedule); without it a block's own steps, which for a
    drafted block are the drafter's — fewer when the drafter has its own schedule.
    """
    drafted = [r for r in records if r.drafted]
    accepted = [r for r in drafted if r.decision == "accept"]
    phases: dict[str, float] = {}
    for r in records:
        for k, v in r.timings.items():
            phases[k] = phases.get(k, 0.0) + v
    decodes = len(records) + len(drafted) - len(accepted)
    est = None
    target = call_stats.get("target", {"calls": 0})
    encode = call_stats.get("encode", {"calls": 0})
    if target["calls"] and records:
        per_forward = target["seconds"] / target["calls"]
        per_decode = phases.get("decode", 0.0) / max(1, decodes)
        per_encode = encode["seconds"] / encode["calls"] if encode["calls"] else 0.0
        def steps(r: BlockRecord) -> int:
            return target_steps[min(r.block, len(target_steps) - 1)] if target_steps else r.steps

        est = sum((steps(r) + policy.target_only_cache_forwards(r.block)) * per_forward + per_decode
                  + policy.context_encodes(r.block) * per_encode for r in records)
    return {
        "blocks": len(records),
        "planned_blocks": planned_blocks,
        "drafted": len(drafted),
        "accepted": len(accepted),
        "acceptance": (len(accepted) / len(drafted)) if drafted else None,
        "wall_s": wall,
        "phase_s": phases,
        "forward_s": {k: (v["seconds"] / v["calls"] if v["calls"] else None) for k, v in call_stats.items()},
        "est_target_only_s": est,
        "speedup_est": (est / wall) if est and wall > 0 else None,
    }
