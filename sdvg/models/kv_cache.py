"""Preallocated self-attention KV cache (global or rolling window with pinned sinks) and cross-attention cache.

Memory of the self-attention cache (K and V, all layers)::

    nbytes = 2 × layers × batch × capacity_frames × tokens_per_frame × heads × head_dim × bytes_per_element

e.g. Self-Forcing 1.3B, 21 frames of 1560 tokens, bf16: 2·30·21·1560·12·128·2 ≈ 6.0 GB; a 6-frame window ≈ 1.7 GB.
Krea 14B (40 layers, 40 heads): 26.8 GB global / 7.7 GB for 6 frames.

Storage is one ``[layers, B, capacity_tokens, heads, head_dim]`` tensor each for K and V, allocated once; layer
``i`` uses the view ``k[i]`` (``[B, capacity_tokens, heads, head_dim]``). Keys are stored after RoPE at their
absolute frame position, or (``rope_on_read=True``, window-relative positions) un-roped and roped at their slot on
every read, so an eviction is a plain copy and positions never outgrow the window. Slots are tracked per latent
frame on the host (a list of logical frame indices), so the sampling loop never syncs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..errors import ConfigError


def kv_cache_nbytes(
    *, num_layers: int, capacity_frames: int, tokens_per_frame: int, heads: int, head_dim: int,
    dtype: torch.dtype = torch.bfloat16, batch: int = 1,
) -> int:
    """The memory formula above, for planning without allocating."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch * capacity_frames * tokens_per_frame * heads * head_dim * itemsize


@dataclass(frozen=True)
class WriteSlots:
    """Token ranges for one block write: new K/V go to [start, end); queries attend to [attend_start, end)."""

    start: int
    end: int
    attend_start: int = 0


class SelfKVCache:
    """Per-layer self-attention K/V, preallocated once and written in place.

    ``rolling=False`` (global): frames are appended in order up to ``capacity_frames``; exceeding it is an error.
    ``rolling=True``: when full, the non-sink frames are shifted left in place (the first ``sink_frames`` frames
    ever written stay pinned) and the new frames are written at the end. Writing a frame that is already cached
    overwrites its slots (and drops any later frames), so re-running a block reuses the same slots.
    """

    def __init__(
        self, *, num_layers: int, batch: int, tokens_per_frame: int, capacity_frames: int, heads: int,
        head_dim: int, device=None, dtype: torch.dtype = torch.float32, rolling: bool = False, sink_frames: int = 0,
        rope_on_read: bool = False,
    ) -> None:
        if min(num_layers, batch, tokens_per_frame, capacity_frames, heads, head_dim) < 1:
            raise ConfigError("KV cache sizes must all be >= 1 (layers, batch, tokens, frames, heads, head_dim).")
        if sink_frames < 0 or (rolling and sink_frames >= capacity_frames):
            raise ConfigError(
                f"sink_frames={sink_frames} must be >= 0 and smaller than the window ({capacity_frames} frames)."
            )
        self.num_layers = num_layers
        self.batch = batch
        self.tokens_per_frame = tokens_per_frame
        self.capacity_frames = capacity_frames
        self.heads = heads
        self.head_dim = head_dim
        self.rolling = rolling
        self.sink_frames = sink_frames if rolling else 0
        self.rope_on_read = bool(rope_on_read)
        shape = (num_layers, batch, capacity_frames * tokens_per_frame, heads, head_dim)
        # Normal (not inference-mode) tensors, so they can be written both inside and outside inference_mode.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._frames: list[int] = []  # logical frame index held by each filled frame slot (sorted)
        # One-write undo of a rolling eviction: pipelined verification drafts block b+1 before block b is decided;
        # if b is then rejected, the frames that b+1's write evicted must come back, or the rewritten block b would
        # see a shorter window than a plain run. Buffers are allocated on the first eviction and reused.
        self._undo_k: torch.Tensor | None = None
        self._undo_v: torch.Tensor | None = None
        self._undo_frames: list[int] = []
        self._undo_by: int | None = None  # first frame of the write that caused the stashed eviction

    # -- introspection -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by K and V (see the module docstring for the formula)."""
        return self.k.numel() * self.k.element_size() * 2

    @property
    def frames(self) -> list[int]:
        """Logical frame index of each filled slot, in slot order."""
        return list(self._frames)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` of layer ``i``: ``[B, capacity_tokens, heads, head_dim]``."""
        return self.k[i], self.v[i]

    def reset(self) -> None:
        """Forget all frames (no memory is touched or freed)."""
        self._frames.clear()
        self._undo_frames = []
        self._undo_by = None

    # -- writes --------------------------------------------------------------------------------------
    def begin_write(self, frame_start: int, num_frames: int) -> WriteSlots:
        """Reserve slots for logical frames [frame_start, frame_start + num_frames); evicts if rolling."""
        if num_frames < 1:
            raise ConfigError("A cache write needs at least one frame.")
        frames = self._frames
        pos = bisect.bisect_left(frames, frame_start)
        if pos < len(frames):
            if self.rolling and frames[pos] != frame_start:
                raise ConfigError(f"Frame {frame_start} was evicted from the rolling window; it cannot be rewritten.")
            del frames[pos:]  # same-slot overwrite (and drop later frames)
            if self._undo_by is not None and frame_start < self._undo_by:
                self._restore_evicted()  # the write that evicted them was dropped: bring them back
        need = len(frames) + num_frames - self.capacity_frames
        if need > 0:
            if not self.rolling:
                raise ConfigError(
                    f"The KV cache holds {self.capacity_frames} latent frames but frame {frame_start + num_frames - 1} "
                    "was requested; start() the denoiser with a larger num_frames."
                )
            self._evict(need, num_frames)
        start = len(frames)
        frames.extend(range(frame_start, frame_start + num_frames))
        tpf = self.tokens_per_frame
        return WriteSlots(start * tpf, (start + num_frames) * tpf, 0)

    def _evict(self, need: int, num_frames: int) -> None:
        """Drop ``need`` frames right after the sinks by shifting the rest left in place (all layers at once)."""
        frames = self._frames
        sink = self.sink_frames
        if self.capacity_frames - sink < num_frames:
            raise ConfigError(
                f"Rolling window of {self.capacity_frames} frames with {sink} sinks cannot hold a "
                f"{num_frames}-frame block; use window_frames >= sink_frames + {num_frames}."
            )
        keep_from = sink + need
        moved = len(frames) - keep_from
        tpf = self.tokens_per_frame
        self._stash(sink, need, frames[-1] + 1 if frames else 0)
        if moved > 0:
            # Copy left in chunks of `need` frames, ascending: no chunk's source overlaps its destination.
            for off in range(0, moved, need):
                n = min(need, moved - off)
                dst = slice((sink + off) * tpf, (sink + off + n) * tpf)
                src = slice((keep_from + off) * tpf, (keep_from + off + n) * tpf)
                self.k[:, :, dst].copy_(self.k[:, :, src])
                self.v[:, :, dst].copy_(self.v[:, :, src])
        del frames[sink:keep_from]

    def _stash(self, slot: int, count: int, by_frame: int) -> None:
        """Keep a copy of the ``count`` frames at ``slot`` that are about to be evicted (one level of undo)."""
        tpf = self.tokens_per_frame
        shape = (self.num_layers, self.batch, count * tpf, self.heads, self.head_dim)
        if self._undo_k is None or self._undo_k.shape[2] < shape[2]:
            self._undo_k = torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
            self._undo_v = torch.empty(shape, device=self.v.device, dtype=self.v.dtype)
        src = slice(slot * tpf, (slot + count) * tpf)
        self._undo_k[:, :, : count * tpf].copy_(self.k[:, :, src])
        self._undo_v[:, :, : count * tpf].copy_(self.v[:, :, src])
        self._undo_frames = self._frames[slot : slot + count]
        self._undo_by = by_frame

    def _restore_evicted(self) -> None:
        """Re-insert the stashed frames after the sinks, shifting the others right in place."""
        frames, sink, tpf = self._frames, self.sink_frames, self.tokens_per_frame
        n = len(self._undo_frames)
        if len(frames) + n > self.capacity_frames:
            raise ConfigError("Cannot restore evicted frames: the rolling window is still full.")
        tail = len(frames) - sink
        # Shift [sink, len) right by n, in descending chunks of n frames so no source overlaps its destination.
        for off in range(tail, 0, -n):
            count = min(n, off)
            src = slice((sink + off - count) * tpf, (sink + off) * tpf)
            dst = slice((sink + off - count + n) * tpf, (sink + off + n) * tpf)
            self.k[:, :, dst].copy_(self.k[:, :, src])
            self.v[:, :, dst].copy_(self.v[:, :, src])
        span = slice(sink * tpf, (sink + n) * tpf)
        self.k[:, :, span].copy_(self._undo_k[:, :, : n * tpf])
        self.v[:, :, span].copy_(self._undo_v[:, :, : n * tpf])
        frames[sink:sink] = self._undo_frames
        self._undo_frames, self._undo_by = [], None

    def prefix_tokens(self, frame_start: int) -> int:
        """Number of cached tokens that belong to frames before ``frame_start`` (for read-only forwards)."""
        return bisect.bisect_left(self._frames, frame_start) * self.tokens_per_frame


class CrossAttnCache:
    """Per-layer cross-attention K/V computed once per prompt: lists of ``[B, text_len, heads, head_dim]``."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        if len(k) != len(v):
            raise ConfigError("Cross-attention cache needs as many K as V tensors.")
        self.k = k
        self.v = v

    def __len__(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
