"""Krea's first context frame for the recompute regime: an old decoded pixel frame, re-encoded as an image.

Before block n (n ≥ 2) the cache is refilled with [first frame, last 2 latent frames]. Krea takes the first frame
from pixels: the oldest of the pixel frames the last two latent frames and the one before them decode to, i.e.
pixel frame 12·n − 12, encoded by the VAE as a standalone image ("image-like", as in training). It is computed once
per (history length, last block) and shared by both models. With pipelined verification the speculative last block
is still being decoded on the worker: its frames come from the verifier ("frames in flight").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..blocks import FRAMES_PER_BLOCK, PIXELS_PER_LATENT_FRAME, pixel_frames_for_blocks
from ..errors import ConfigError
from .calls import Hooks
from .results import FrameBuffer

if TYPE_CHECKING:
    from ..models.vae import StreamingVAE
    from .history import BlockHistory

# the pixel frames of the last two latent frames (2 × 4) and the one before them
LOOKBACK = (FRAMES_PER_BLOCK - 1) * PIXELS_PER_LATENT_FRAME + 1
_KEEP = 4  # the committed and the speculative history of two blocks


class ContextFrames:
    def __init__(self, vae: StreamingVAE, frames: FrameBuffer, in_flight: Callable[[int], torch.Tensor | None],
                 hooks: Hooks) -> None:
        self.vae = vae
        self.frames = frames
        self.in_flight = in_flight
        self.hooks = hooks
        self._latents: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, history: BlockHistory) -> torch.Tensor:
        n = len(history)
        key = (n, history.blocks[-1].token)
        if key not in self._latents:
            frame = self._pixel_frame(n, pixel_frames_for_blocks(n) - LOOKBACK)
            with self.hooks.call("encode"):
                latent = self.vae.encode_frame(frame)
            if len(self._latents) >= _KEEP:
                self._latents.pop(next(iter(self._latents)))
            self._latents[key] = latent
        return self._latents[key]

    def _pixel_frame(self, n: int, index: int) -> torch.Tensor:
        if index < self.frames.count:
            return self.frames.frame(index)
        drafted = self.in_flight(n - 1)  # pipelined: the speculative block n − 1
        if drafted is None:
            raise ConfigError(f"Pixel frame {index} for block {n}'s context is not decoded yet.")
        offset = index - pixel_frames_for_blocks(n - 1)  # position inside that block's own frames
        return drafted[offset : offset + 1]
