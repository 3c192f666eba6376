"""Deterministic random inputs shared by the model tests and their loading tests."""

from __future__ import annotations

import torch


def latents(seed: int, f: int = 3, h: int = 2, w: int = 2) -> torch.Tensor:
    """Normalized Wan latents ``[1, 16, f, h, w]`` (2×2 latents = 16×16 pixels keep the VAE tests fast)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, f, h, w, generator=g)


def frames(n: int = 4, h: int = 48, w: int = 80, seed: int = 0) -> torch.Tensor:
    """Pixel frames ``[n, h, w, 3]`` in [0, 1] (ComfyUI IMAGE layout)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, h, w, 3, generator=g)
