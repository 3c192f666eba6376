"""Verifying a draft: snapshot the streaming VAE, decode the draft, score it, route it (SPEC §1 steps 3–4).

Two strategies with one interface (``draft``, ``verify``, ``frames_in_flight``, ``close``), both built on explicit
collaborators (the denoising stage, the VAE, the reward model, the router, the history: ``stages.py``):

- :class:`SequentialVerifier` drafts, then verifies, on the calling thread.
- :class:`PipelinedVerifier` decodes and scores block b on a worker thread (and, on CUDA, a side stream of the
  VAE's device) while the main thread drafts block b + 1 on the history that assumes b is accepted. The
  speculative draft is used only if that assumption held (its base is the block that was committed); on a reject
  it is thrown away. It owns the thread, the stream and the prefetched draft.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, NonFiniteError
from .history import BlockHistory
from .routing import RouteRecord
from .stages import Decoding, Denoising, Draft, Scoring, last_token

if TYPE_CHECKING:
    from ..models.vae import VAEState
    from .router import Router

logger = logging.getLogger(__name__)


@dataclass
class Verification:
    """The outcome of verifying one draft: the VAE state before its decode, its frames and the routing decision."""

    snapshot: VAEState
    frames: torch.Tensor
    route: RouteRecord


class SequentialVerifier:
    """Drafts, then verifies, on the calling thread. Its collaborators are explicit: the denoising stage (the
    drafter), the VAE and the reward model (decode, score), the router and the committed history."""

    def __init__(self, denoising: Denoising, decoding: Decoding, scoring: Scoring | None, router: Router,
                 history: BlockHistory, num_blocks: int) -> None:
        self.denoising, self.decoding, self.scoring = denoising, decoding, scoring
        self.router, self.history, self.num_blocks = router, history, num_blocks

    def draft(self, block: int, timings: dict) -> Draft:
        return self.denoising.draft(block, self.history, timings)

    def verify(self, draft: Draft, timings: dict) -> Verification:
        return self.check(draft, timings)

    def frames_in_flight(self, block: int) -> torch.Tensor | None:
        return None

    def close(self) -> None:
        pass

    def draftable(self, block: int) -> bool:
        return block < self.num_blocks and self.router.forced_target(block) is None

    def check(self, draft: Draft, timings: dict,
              on_decoded: Callable[[torch.Tensor | None], None] | None = None) -> Verification:
        """Snapshot the VAE, decode the draft, score and route it. ``on_decoded`` gets the frames (None if the decode
        failed) as soon as they exist, before scoring. A non-finite draft is rejected without a decode."""
        snapshot = self.decoding.snapshot()
        if not draft.finite:
            if on_decoded is not None:
                on_decoded(None)
            return Verification(snapshot, None, self._unverifiable(draft))
        frames = None
        try:
            frames = self.decoding.decode(draft.result.x0, timings)
        finally:
            if on_decoded is not None:
                on_decoded(frames)  # never leave a waiting drafter hanging, even if the decode failed
        scores = self.scoring.frame_scores(draft.block, frames, timings) if self.scoring is not None else None
        return Verification(snapshot, frames, self.router.decide(draft.block, scores))

    def _unverifiable(self, draft: Draft) -> RouteRecord:
        if not self.denoising.has_target:
            raise NonFiniteError(f"The drafter produced NaN/inf latents in block {draft.block} and draft-only mode has "
                                 "no target to redo it. Load the drafter in bf16 or fp32, or check its checkpoint.")
        logger.warning("block %d: the drafter produced NaN/inf latents; the target makes the block", draft.block)
        return self.router.fault_record(draft.block, "non-finite draft: the drafter produced NaN/inf latents")


class _InFlight:
    """The frames of a draft being decoded on the worker, for the main thread to wait on."""

    def __init__(self, block: int, side_stream) -> None:
        self.block = block
        self.ready = threading.Event()
        self.frames: torch.Tensor | None = None
        self._side_stream = side_stream

    def publish(self, frames: torch.Tensor | None) -> None:
        if frames is not None and self._side_stream is not None:
            self._side_stream.synchronize()  # the drafting thread reads these frames on its own stream
        self.frames = frames
        self.ready.set()


class PipelinedVerifier(SequentialVerifier):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdvg-verify")
        device = self.decoding.device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.prefetched: Draft | None = None
        self.in_flight: _InFlight | None = None

    def draft(self, block: int, timings: dict) -> Draft:
        draft, self.prefetched = self.prefetched, None
        if draft is not None and draft.block == block and draft.base == last_token(self.history):
            return draft
        return super().draft(block, timings)

    def verify(self, draft: Draft, timings: dict) -> Verification:
        """Verify ``draft`` on the worker while drafting the next block, assuming ``draft`` is accepted."""
        if not draft.finite or not self.draftable(draft.block + 1):  # nothing to overlap, or nothing to build on
            return self.check(draft, timings)
        ready = None
        if self.side_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.denoising.device("drafter")))
        self.in_flight = _InFlight(draft.block, self.side_stream)
        worker_timings: dict[str, float] = {}
        future = self.executor.submit(self._check_on_worker, draft, ready, worker_timings, self.in_flight)
        try:
            self.prefetched = self.denoising.draft(draft.block + 1, self.history.extended(draft.history_block), timings)
        finally:
            start = time.perf_counter()
            verification = future.result()
            timings["verify_wait"] = time.perf_counter() - start
        for key, value in worker_timings.items():
            timings[key] = timings.get(key, 0.0) + value
        return verification

    def _check_on_worker(self, draft: Draft, ready, timings: dict, in_flight: _InFlight) -> Verification:
        if self.side_stream is None:
            return self.check(draft, timings, in_flight.publish)
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(ready)
            return self.check(draft, timings, in_flight.publish)

    def frames_in_flight(self, block: int) -> torch.Tensor | None:
        flight = self.in_flight
        if flight is None or flight.block != block:
            return None
        flight.ready.wait()
        if flight.frames is None:
            raise ConfigError(f"The speculative draft of block {block} could not be decoded.")
        return flight.frames

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def make_verifier(pipelined: bool, *args, **kwargs) -> SequentialVerifier:
    """The verifier strategy: pipelined (a worker decodes and scores while the next block is drafted) or not."""
    return (PipelinedVerifier if pipelined else SequentialVerifier)(*args, **kwargs)
