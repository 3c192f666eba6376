"""What a generation gives back: per-step and per-block events, block records and the result (diffusers-style output
dataclasses). Plain data; the sampler fills them in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .jsonable import to_jsonable


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

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))


@dataclass
class BlockEvent:
    block: int
    frames: torch.Tensor  # [N, H, W, 3] float32 in [0, 1], on the CPU
    record: BlockRecord


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
    """The output frames of one run, preallocated once: finished blocks are copied in, in order."""

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
