"""Block geometry shared by the sampler, the caches, the VAE glue and the tools: one home for these numbers.

A block is 3 latent frames. The Wan 2.1 VAE is causal in time: the first latent frame of a video decodes to one
pixel frame and every later one to four, so block 0 gives 9 pixel frames and every later block 12.
"""

from __future__ import annotations

import math

FRAMES_PER_BLOCK = 3  # latent frames per block
LATENT_CHANNELS = 16  # Wan 2.1 latent channels
VAE_SCALE = 8  # pixels per latent cell, each spatial axis
SPATIAL_MULTIPLE = 16  # VAE ×8, then the DiT's 2×2 patches
PIXELS_PER_LATENT_FRAME = 4  # after the first latent frame of a video
ROPE_POSITIONS = 1024  # Wan 2.1's RoPE table (positions per axis) when a DiT's config does not say


def rope_positions(dit_config) -> int:
    """Positions per axis a DiT's RoPE table holds (its ``rope_max_seq_len``)."""
    return int(dit_config.get("rope_max_seq_len", ROPE_POSITIONS))


def pixel_frames_for_blocks(num_blocks: int) -> int:
    """Pixel frames of ``num_blocks`` blocks: 9 for block 0, 12 for every later block."""
    return FRAMES_PER_BLOCK * PIXELS_PER_LATENT_FRAME * num_blocks - (PIXELS_PER_LATENT_FRAME - 1)


def blocks_for_frames(num_frames: int) -> int:
    """The fewest blocks that give at least ``num_frames`` pixel frames."""
    per_block = FRAMES_PER_BLOCK * PIXELS_PER_LATENT_FRAME
    return max(1, math.ceil((num_frames + PIXELS_PER_LATENT_FRAME - 1) / per_block))
