"""What one generation allocates beyond the weights, per device, computed before anything is allocated.

A host that manages memory (ComfyUI's ``load_models_gpu``) is told these figures so it can make room first:

* each DiT that runs: its self-attention KV cache (the cache policy's layout, in the compute dtype — bf16 even with
  fp8 weights) and its cross-attention cache (one K and V per layer for the 512 text tokens), on the DiT's device;
* the streaming VAE: its decoder cache, twice (the live cache plus the entries a snapshot keeps alive while a draft
  is decoded), on the VAE's device.

Activations are not included (a host adds its own minimum for them). The decoder cache is measured, not guessed:
one two-block decode at a 4×4 latent (it reaches its steady size after the first block); every entry scales with
the latent area, so that measurement scales exactly to any size.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..blocks import FRAMES_PER_BLOCK, LATENT_CHANNELS
from ..models.kv_cache import kv_cache_nbytes
from .regimes import CacheConfig
from .router import runs_model

if TYPE_CHECKING:
    from ..loaders.bundle import SDVGModels
    from ..models.vae import StreamingVAE

TEXT_TOKENS = 512
_PROBE_HW = (4, 4)
_vae_bytes_per_latent_pixel: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_cache_bytes(model, cache: CacheConfig, num_frames: int, latent_hw: tuple[int, int]) -> int:
    """Self-attention KV-cache bytes the sampler allocates for ``model`` under ``cache`` (the policy's layout)."""
    layout = cache.policy().layout(num_frames)
    return kv_cache_nbytes(
        num_layers=len(model.blocks), capacity_frames=layout.capacity_frames,
        tokens_per_frame=model.tokens_per_frame(*latent_hw), heads=model.num_heads, head_dim=model.head_dim,
        dtype=model.compute_dtype,
    )


def cross_attn_bytes(model) -> int:
    """One K and one V per layer for the text tokens, in the compute dtype."""
    itemsize = torch.empty((), dtype=model.compute_dtype).element_size()
    return 2 * len(model.blocks) * TEXT_TOKENS * model.num_heads * model.head_dim * itemsize


def vae_cache_bytes(vae: StreamingVAE, latent_hw: tuple[int, int]) -> int:
    """The streaming decoder's steady cache size at ``latent_hw`` (measured once per VAE at 4×4, then scaled)."""
    per_pixel = _vae_bytes_per_latent_pixel.get(vae)
    if per_pixel is None:
        state = vae.snapshot()
        try:
            vae.reset()
            with torch.no_grad():
                for _ in range(2):
                    vae.decode_block(torch.zeros((1, LATENT_CHANNELS, FRAMES_PER_BLOCK, *_PROBE_HW),
                                                 device=vae.device, dtype=vae.dtype))
            per_pixel = vae.cache_nbytes / (_PROBE_HW[0] * _PROBE_HW[1])
        finally:
            vae.restore(state)
        _vae_bytes_per_latent_pixel[vae] = per_pixel
    return int(per_pixel * latent_hw[0] * latent_hw[1])


def run_memory(models: SDVGModels, *, cache: CacheConfig, num_blocks: int, width: int, height: int,
               mode: str) -> dict[torch.device, int]:
    """Bytes a run of ``num_blocks`` at ``width``×``height`` allocates per device (see the module docstring).
    ``mode`` is the routing mode: draft-only never runs the target's caches, target-only never the drafter's."""
    latent_hw = (height // 8, width // 8)
    num_frames = num_blocks * FRAMES_PER_BLOCK
    need: dict[torch.device, int] = {}

    def add(device, nbytes: int) -> None:
        dev = torch.device(device)
        need[dev] = need.get(dev, 0) + int(nbytes)

    for role, model in (("target", models.target), ("drafter", models.drafter)):
        if model is not None and runs_model(mode, role):
            add(model.execution_device, kv_cache_bytes(model, cache, num_frames, latent_hw) + cross_attn_bytes(model))
    add(models.vae.device, 2 * vae_cache_bytes(models.vae, latent_hw))
    return need
