"""What a generation gives back: per-step and per-block events, block records and the result (diffusers-style output
dataclasses). Plain data; the sampler fills them in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..jsonable import to_jsonable


@dataclass
class StepEvent:
    block: int
    model: str
    step: int
    num_steps: int


@dataclass
class BlockRecord:
    """One finished block. ``timings`` are seconds per phase (draft, decode, score, target, cache, output); in
    pipelined mode decode and score of a draft ran on the worker while the main thread drafted the next block,
    so the phases can add up to more than the block's wall time (``verify_wait`` is what the main thread waited)."""

    block: int
    decision: str
    reason: str
    produced_by: str
    steps: int
    q: float | None = None
    scores: list[float] = field(default_factory=list)
    tau: float | None = None
    aggregation: str | None = None
    drafted: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    forwards: dict[str, int] = field(default_factory=dict)
    prompt: str | None = None  # a prompt timeline: the prompt that starts at this block (a switch), else None

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))


@dataclass
class BlockEvent:
    block: int
    frames: torch.Tensor  # [N, H, W, 3] float32 in [0, 1], on the CPU
    record: BlockRecord
    # what the run holds after this block: KV-cache bytes and frames per model, history blocks, output frames, VAE
    # decoder bytes (flat in the block count with keep_output=False)
    footprint: dict = field(default_factory=dict)


@dataclass
class SDVGResult:
    frames: torch.Tensor
    latents: torch.Tensor
    blocks: list[BlockRecord]
    partial: bool
    totals: dict
    settings: dict

    def report(self) -> dict:
        return to_jsonable({
            "settings": self.settings,
            "partial": self.partial,
            "totals": self.totals,
            "blocks": [b.to_dict() for b in self.blocks],
        })


class FrameBuffer:
    """The output frames of one run, preallocated once: finished blocks are copied in, in order.

    Grows with the video (``SamplerConfig.keep_output=True``); long videos use :class:`FrameTail`."""

    def __init__(self, num_frames: int, height: int, width: int) -> None:
        self._frames = torch.empty((num_frames, height, width, 3))
        self.count = 0

    def append(self, frames: torch.Tensor) -> torch.Tensor:
        """Copy a block's frames in (one copy; they may live on another device) and return their view."""
        out = self._frames[self.count : self.count + frames.shape[0]]
        out.copy_(frames)
        self.count += frames.shape[0]
        return out

    def frame(self, index: int) -> torch.Tensor:
        """Pixel frame ``index`` as ``[1, H, W, 3]`` (it must be finished)."""
        return self._frames[index : index + 1]

    def finished(self) -> torch.Tensor:
        return self._frames[: self.count]


class FrameTail:
    """The output frames of a run that hands them on (``keep_output=False``): only the last ``keep_blocks`` blocks'
    frames are held (the recompute regime re-encodes one of them as context), so memory is flat in the length.
    Each block's frames are one tensor of their own, so a consumer may hold on to them."""

    def __init__(self, height: int, width: int, keep_blocks: int = 2) -> None:
        self._blocks: list[tuple[int, torch.Tensor]] = []  # (index of the first frame, frames)
        self._keep = keep_blocks
        self._empty = torch.empty((0, height, width, 3))
        self.count = 0

    def append(self, frames: torch.Tensor) -> torch.Tensor:
        out = frames.to("cpu", torch.float32, copy=True)
        self._blocks.append((self.count, out))
        del self._blocks[: -self._keep]
        self.count += out.shape[0]
        return out

    def frame(self, index: int) -> torch.Tensor:
        for first, frames in reversed(self._blocks):
            if first <= index < first + frames.shape[0]:
                return frames[index - first : index - first + 1]
        raise IndexError(f"Pixel frame {index} is no longer held (only the last {self._keep} blocks are).")

    @property
    def held_frames(self) -> int:
        return sum(f.shape[0] for _, f in self._blocks)

    def finished(self) -> torch.Tensor:
        return self._empty
