"""Starting from frames: given first blocks (image-to-video, extension) and video-to-video.

**Given first blocks** (:class:`InitBlocks`). Frames (an image held for block 0's 9 frames, or the 9 + 12k frames of a
clip) are encoded by the streaming VAE, or latents (a finished run's ``--save-latents``) are taken as they are; they
become the first whole blocks of the video: committed history that both models condition on, decoded (which primes
the VAE decoder's stream) and output, never drafted or scored (their records say ``produced_by = "input"``). The
sampler generates the remaining blocks. Extending a finished video from its latents continues it exactly: each
cache is rebuilt from the same history, and block b still uses the noise of (seed, b).

**Video-to-video (Krea)**: every block starts from the input video's latents noised to a strength, not from noise.

At strength ``s`` a block's few-step schedule is truncated to the timesteps ``t ≤ 1000·s``: with ``k`` steps
dropped, the block starts from ``x = (1 − σ_k)·y_b + σ_k·ε_b,k−1`` (``y_b`` the input's latents of the block,
``ε`` the block's own seeded re-noise tensor of that step, from the run's ``NoiseBank``) and runs the remaining
steps: the drafter and a rejecting target alike, so the router works unchanged and a rerun is identical. At
``s = 1`` nothing is dropped and the block starts from its pure noise ``z_b`` (text-to-video, bit-identical); at
``s = 0`` every step is dropped and the block is the input's latents.

The input is encoded once, up front, by the streaming VAE's causal encoder (``StreamingVAE.encode_video``): its
frames must be in RAM (the latents are 1/48 of their size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..blocks import FRAMES_PER_BLOCK, pixel_frames_for_blocks
from ..errors import ConfigError


def check_strength(strength: float) -> float:
    s = float(strength)
    if not math.isfinite(s) or not 0.0 <= s <= 1.0:
        raise ConfigError(f"The video-to-video strength must be between 0 and 1, got {strength!r}.")
    return s


@dataclass
class InitBlocks:
    """The latents ``[1, 16, 3·k, h, w]`` of the video's first k blocks, given rather than generated."""

    latents: torch.Tensor

    def __post_init__(self) -> None:
        lat = self.latents
        if not torch.is_tensor(lat) or lat.ndim != 5 or lat.shape[0] != 1 or lat.shape[2] % FRAMES_PER_BLOCK \
                or lat.shape[2] == 0:
            raise ConfigError(f"Given first blocks need latents [1, 16, 3·k, h, w] (whole blocks of {FRAMES_PER_BLOCK} "
                              f"latent frames); got {tuple(lat.shape) if torch.is_tensor(lat) else type(lat).__name__}.")

    @classmethod
    def from_frames(cls, vae, frames: torch.Tensor) -> InitBlocks:
        """``frames [N, H, W, 3]`` in [0, 1]: one image is held for block 0's 9 frames; a clip gives its first
        9 + 12k frames (whole blocks; the rest is dropped)."""
        if frames.ndim != 4 or frames.shape[0] < 1:
            raise ConfigError(f"Given frames must be [N, H, W, 3]; got {tuple(frames.shape)}.")
        if frames.shape[0] == 1:
            frames = frames.expand(pixel_frames_for_blocks(1), -1, -1, -1)
        blocks = (frames.shape[0] + 3) // 12
        if blocks < 1:
            raise ConfigError(f"{frames.shape[0]} frames make no whole block: give one image, or at least 9 frames "
                              "(9 + 12k make k + 1 blocks).")
        return cls(vae.encode_video(frames[: pixel_frames_for_blocks(blocks)].contiguous()))

    @property
    def num_blocks(self) -> int:
        return self.latents.shape[2] // FRAMES_PER_BLOCK

    def check_fits(self, num_blocks: int, latent_hw: tuple[int, int]) -> None:
        h, w = self.latents.shape[3:]
        if (h, w) != tuple(latent_hw):
            raise ConfigError(f"The given frames are {w * 8}×{h * 8} pixels but the run is {latent_hw[1] * 8}×"
                              f"{latent_hw[0] * 8}; resize them or change the size.")
        if self.num_blocks >= num_blocks:
            raise ConfigError(f"The given frames fill {self.num_blocks} block(s) but the video has {num_blocks}: "
                              "ask for more blocks, the rest are generated.")

    def block(self, b: int) -> torch.Tensor:
        return self.latents[:, :, b * FRAMES_PER_BLOCK : (b + 1) * FRAMES_PER_BLOCK]


@dataclass
class VideoToVideo:
    """The input video's normalized latents ``[1, 16, F, h, w]`` and the strength they are denoised at."""

    latents: torch.Tensor
    strength: float

    def __post_init__(self) -> None:
        self.strength = check_strength(self.strength)
        if not torch.is_tensor(self.latents) or self.latents.ndim != 5 or self.latents.shape[0] != 1:
            raise ConfigError("Video-to-video needs the input's latents as [1, 16, F, h, w].")

    @classmethod
    def from_frames(cls, vae, frames: torch.Tensor, strength: float, num_blocks: int | None = None) -> VideoToVideo:
        """Encode the first ``12·num_blocks − 3`` of ``frames [N, H, W, 3]`` (in [0, 1]; more are ignored; None: as
        many whole blocks as the frames make)."""
        check_strength(strength)
        if num_blocks is None:
            num_blocks = max(1, (frames.shape[0] + 3) // 12)
        need = pixel_frames_for_blocks(num_blocks)
        if frames.shape[0] < need:
            raise ConfigError(f"The input video has {frames.shape[0]} frames; {num_blocks} blocks need {need}. Use "
                              f"{max(1, (frames.shape[0] + 3) // 12)} block(s) or a longer video.")
        return cls(vae.encode_video(frames[:need]), strength)

    def check_fits(self, num_blocks: int, latent_hw: tuple[int, int]) -> None:
        f, h, w = self.latents.shape[2:]
        if (h, w) != tuple(latent_hw):
            raise ConfigError(f"The input video's latents are {w * 8}×{h * 8} pixels but the run is "
                              f"{latent_hw[1] * 8}×{latent_hw[0] * 8}; resize the video or change the size.")
        if f < num_blocks * FRAMES_PER_BLOCK:
            raise ConfigError(f"The input video covers {f // FRAMES_PER_BLOCK} block(s); the run has {num_blocks}.")

    def start_step(self, timesteps: list[float]) -> int:
        """How many of a block's steps are dropped: those above 1000·strength."""
        return sum(1 for t in timesteps if t > 1000.0 * self.strength)

    def block(self, b: int) -> torch.Tensor:
        return self.latents[:, :, b * FRAMES_PER_BLOCK : (b + 1) * FRAMES_PER_BLOCK]
