"""The committed blocks of one generation (the context both models condition on) and the result of denoising one.

Each denoise gets a fresh ``token``; a history block carries the token of the result it came from, so a cache can
tell whether it holds exactly that block (and not, say, a rejected draft of the same index).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

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
    """The committed blocks of one generation, in order.

    Long videos drop old blocks (:meth:`drop_before`) once no cache needs them: ``blocks`` then holds the recent
    blocks only, ``start`` is the index of the first held one, ``len()`` still counts every committed block, and the
    first latent frame of block 0 (the recompute regime's ``first_frame="latent"`` context) is kept apart.
    """

    def __init__(self) -> None:
        self.blocks: list[HistoryBlock] = []
        self.start = 0  # index of blocks[0]
        self._dropped_frames = 0
        self._first_frame: torch.Tensor | None = None

    def append(self, block: HistoryBlock) -> None:
        if block.index != len(self):
            raise ConfigError(f"History expects block {len(self)} next, got block {block.index}.")
        if block.index == 0:
            self._first_frame = block.x0[:, :, :1]
        self.blocks.append(block)

    def __len__(self) -> int:
        return self.start + len(self.blocks)

    def extended(self, block: HistoryBlock) -> BlockHistory:
        """A new history: these blocks plus ``block`` (e.g. a speculative, not yet accepted draft)."""
        out = BlockHistory()
        out.blocks, out.start, out._dropped_frames = list(self.blocks), self.start, self._dropped_frames
        out._first_frame = self._first_frame
        out.append(block)
        return out

    def drop_before(self, index: int) -> None:
        """Forget the latents of blocks before ``index`` (at most all but the last block); memory stays flat."""
        n = min(int(index), len(self) - 1) - self.start
        if n <= 0:
            return
        self._dropped_frames += sum(b.x0.shape[2] for b in self.blocks[:n])
        del self.blocks[:n]
        self.start += n

    @property
    def complete(self) -> bool:
        """Whether every committed block's latents are still held."""
        return self.start == 0

    def first_latent_frame(self) -> torch.Tensor:
        """Latent frame 0 of the video (kept when block 0 itself was dropped)."""
        if self._first_frame is None:
            raise ConfigError("The block history is empty.")
        return self._first_frame

    def latents(self) -> torch.Tensor:
        """All clean latents ``[B, 16, F, h, w]``."""
        if not self.blocks:
            raise ConfigError("The block history is empty.")
        if self.start:
            raise ConfigError(f"Blocks before {self.start} were dropped (keep_output=False); their latents are gone.")
        return torch.cat([b.x0 for b in self.blocks], dim=2)

    def _held(self, upto: int | None) -> list[HistoryBlock]:
        if upto is None:
            return self.blocks
        if upto < self.start:
            raise ConfigError(f"Blocks before {self.start} were dropped; block {upto}'s context is gone.")
        return self.blocks[: upto - self.start]

    def num_frames(self, upto: int | None = None) -> int:
        return self._dropped_frames + sum(b.x0.shape[2] for b in self._held(upto))

    def tail_frames(self, n: int, upto: int | None = None) -> torch.Tensor:
        """The last ``n`` latent frames of blocks ``[0, upto)`` (fewer if the history is shorter)."""
        parts: list[torch.Tensor] = []
        need = n
        for b in reversed(self._held(upto)):
            if need <= 0:
                break
            take = min(need, b.x0.shape[2])
            parts.append(b.x0[:, :, b.x0.shape[2] - take:])
            need -= take
        if need > 0 and self.start:
            raise ConfigError(f"Blocks before {self.start} were dropped; {n} context frames are not held.")
        return torch.cat(parts[::-1], dim=2)
