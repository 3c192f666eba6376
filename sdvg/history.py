"""The committed blocks of one generation (the context both models condition on) and the result of denoising one.

Each denoise gets a fresh ``token``; a history block carries the token of the result it came from, so a cache can
tell whether it holds exactly that block (and not, say, a rejected draft of the same index).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .errors import ConfigError

_TOKENS = itertools.count(1)


@dataclass
class DenoiseResult:
    x0: torch.Tensor
    last_noisy: torch.Tensor
    last_t: float
    forwards: int
    token: int = field(default_factory=lambda: next(_TOKENS))
    x0_kept: torch.Tensor | None = None  # the x0 prediction of the step asked for (step stitch), a reference


@dataclass
class HistoryBlock:
    """A finished block: its clean latents, its last noisy model input and timestep, and the result token."""

    index: int
    x0: torch.Tensor
    last_noisy: torch.Tensor | None
    last_t: float
    token: int

    @classmethod
    def of(cls, index: int, result: DenoiseResult) -> HistoryBlock:
        """The history entry of a denoised block."""
        return cls(index, result.x0, result.last_noisy, result.last_t, result.token)


class BlockHistory:
    """The committed blocks of one generation, in order."""

    def __init__(self) -> None:
        self.blocks: list[HistoryBlock] = []

    def append(self, block: HistoryBlock) -> None:
        if block.index != len(self.blocks):
            raise ConfigError(f"History expects block {len(self.blocks)} next, got block {block.index}.")
        self.blocks.append(block)

    def __len__(self) -> int:
        return len(self.blocks)

    def extended(self, block: HistoryBlock) -> BlockHistory:
        """A new history: these blocks plus ``block`` (e.g. a speculative, not yet accepted draft)."""
        out = BlockHistory()
        out.blocks = [*self.blocks, block]
        if block.index != len(self.blocks):
            raise ConfigError(f"History expects block {len(self.blocks)} next, got block {block.index}.")
        return out

    def latents(self) -> torch.Tensor:
        """All clean latents ``[B, 16, F, h, w]``."""
        if not self.blocks:
            raise ConfigError("The block history is empty.")
        return torch.cat([b.x0 for b in self.blocks], dim=2)

    def num_frames(self, upto: int | None = None) -> int:
        return sum(b.x0.shape[2] for b in self.blocks[:upto])

    def tail_frames(self, n: int, upto: int | None = None) -> torch.Tensor:
        """The last ``n`` latent frames of blocks ``[0, upto)`` (fewer if the history is shorter)."""
        parts: list[torch.Tensor] = []
        need = n
        for b in reversed(self.blocks[:upto]):
            if need <= 0:
                break
            take = min(need, b.x0.shape[2])
            parts.append(b.x0[:, :, b.x0.shape[2] - take:])
            need -= take
        return torch.cat(parts[::-1], dim=2)
