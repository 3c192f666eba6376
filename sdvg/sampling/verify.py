"""Verifying a draft: snapshot the streaming VAE, decode the draft, score it, route it (SPEC §1 steps 3–4).

Two strategies with one interface (``draft``, ``verify``, ``frames_in_flight``, ``close``):

- :class:`SequentialVerifier` drafts, then verifies, on the calling thread.
- :class:`PipelinedVerifier` decodes and scores block b on a worker thread (and, on CUDA, a side stream of the
  VAE's device) while the main thread drafts block b + 1 on the history that assumes b is accepted. The
  speculative draft is used only if that assumption held (its base is the block that was committed); on a reject
  it is thrown away. It owns the thread, the stream and the prefetched draft.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import ConfigError
from .history import BlockHistory, DenoiseResult, HistoryBlock
from .router import RouteRecord

if TYPE_CHECKING:
    from ..models.vae import VAEState


@dataclass
class Draft:
    block: int
    result: DenoiseResult
    base: int | None  # token of the last history block it was drafted on (None: drafted on an empty history)
    finite: bool = True  # False: the drafter produced NaN/inf latents; the draft is rejected without decoding

    @property
    def history_block(self) -> HistoryBlock:
        return HistoryBlock.of(self.block, self.result)


@dataclass
class Verification:
    """The outcome of verifying one draft: the VAE state before its decode, its frames and the routing decision."""

    snapshot: VAEState
    frames: torch.Tensor
    route: RouteRecord


class VerifyHost(Protocol):
    """What a verifier needs from the run (``sampler._Run``)."""

    history: BlockHistory
    vae: object
    aux_device: torch.device
    drafter_device: torch.device

    def draft_on(self, block: int, history: BlockHistory, timings: dict) -> Draft: ...

    def draftable(self, block: int) -> bool: ...

    def decode(self, latents: torch.Tensor, timings: dict) -> torch.Tensor: ...

    def route(self, block: int, frames: torch.Tensor, timings: dict) -> RouteRecord: ...

    def reject_unverifiable(self, draft: Draft) -> RouteRecord: ...


def last_token(history: BlockHistory) -> int | None:
    return history.blocks[-1].token if len(history) else None


def check(host: VerifyHost, draft: Draft, timings: dict,
          on_decoded: Callable[[torch.Tensor | None], None] | None = None) -> Verification:
    """Snapshot the VAE, decode the draft, score and route it. ``on_decoded`` gets the frames (None if the decode
    failed) as soon as they exist, before scoring. A non-finite draft is rejected without a decode."""
    snapshot = host.vae.snapshot()
    if not draft.finite:
        if on_decoded is not None:
            on_decoded(None)
        return Verification(snapshot, None, host.reject_unverifiable(draft))
    frames = None
    try:
        frames = host.decode(draft.result.x0, timings)
    finally:
        if on_decoded is not None:
            on_decoded(frames)  # never leave a waiting drafter hanging, even if the decode failed
    return Verification(snapshot, frames, host.route(draft.block, frames, timings))


class SequentialVerifier:
    def __init__(self, host: VerifyHost) -> None:
        self.host = host

    def draft(self, block: int, timings: dict) -> Draft:
        return self.host.draft_on(block, self.host.history, timings)

    def verify(self, draft: Draft, timings: dict) -> Verification:
        return check(self.host, draft, timings)

    def frames_in_flight(self, block: int) -> torch.Tensor | None:
        return None

    def close(self) -> None:
        pass


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
    def __init__(self, host: VerifyHost) -> None:
        super().__init__(host)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdvg-verify")
        cuda = host.aux_device.type == "cuda"
        self.side_stream = torch.cuda.Stream(host.aux_device) if cuda else None
        self.prefetched: Draft | None = None
        self.in_flight: _InFlight | None = None

    def draft(self, block: int, timings: dict) -> Draft:
        draft, self.prefetched = self.prefetched, None
        if draft is not None and draft.block == block and draft.base == last_token(self.host.history):
            return draft
        return super().draft(block, timings)

    def verify(self, draft: Draft, timings: dict) -> Verification:
        """Verify ``draft`` on the worker while drafting the next block, assuming ``draft`` is accepted."""
        host = self.host
        if not draft.finite or not host.draftable(draft.block + 1):  # nothing to overlap, or nothing to build on
            return check(host, draft, timings)
        ready = None
        if self.side_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(host.drafter_device))
        self.in_flight = _InFlight(draft.block, self.side_stream)
        worker_timings: dict[str, float] = {}
        future = self.executor.submit(self._check_on_worker, draft, ready, worker_timings, self.in_flight)
        try:
            self.prefetched = host.draft_on(draft.block + 1, host.history.extended(draft.history_block), timings)
        finally:
            start = time.perf_counter()
            verification = future.result()
            timings["verify_wait"] = time.perf_counter() - start
        for key, value in worker_timings.items():
            timings[key] = timings.get(key, 0.0) + value
        return verification

    def _check_on_worker(self, draft: Draft, ready, timings: dict, in_flight: _InFlight) -> Verification:
        if self.side_stream is None:
            return check(self.host, draft, timings, in_flight.publish)
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(ready)
            return check(self.host, draft, timings, in_flight.publish)

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


def make_verifier(host: VerifyHost, pipelined: bool) -> SequentialVerifier:
    return PipelinedVerifier(host) if pipelined else SequentialVerifier(host)
