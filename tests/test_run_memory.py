"""The memory a run announces before it allocates equals what it then allocates (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch

from sdvg.blocks import FRAMES_PER_BLOCK
from sdvg.sampling import footprint as rm
from sdvg.sampling.causal import BlockDenoiser
from sdvg.sampling.footprint import cross_attn_bytes, kv_cache_bytes, run_memory, vae_cache_bytes
from sdvg.sampling.regimes import REGIMES, CacheConfig


@pytest.mark.parametrize("regime", REGIMES)
def test_dit_caches_equal_the_plan(tiny_models, regime):
    model, cache = tiny_models.target, CacheConfig(regime)
    den = BlockDenoiser(model, cache, name="target")
    embeds = torch.zeros((1, 512, model.config.text_dim))
    den.start(embeds, latent_shape=(4, 6), num_frames=4 * FRAMES_PER_BLOCK)
    assert den.kv.nbytes == kv_cache_bytes(model, cache, 4 * FRAMES_PER_BLOCK, (4, 6))
    assert den.cross.nbytes == cross_attn_bytes(model)


@pytest.mark.parametrize("hw", [(4, 6), (8, 8)])
def test_vae_cache_scales_exactly_from_the_probe(tiny_models, hw):
    vae = tiny_models.vae
    predicted = vae_cache_bytes(vae, hw)
    vae.reset()
    with torch.no_grad():
        for _ in range(3):
            vae.decode_block(torch.zeros((1, 16, 3, *hw)))
    assert vae.cache_nbytes == predicted
    vae.reset()


def test_probe_leaves_the_decoder_state_alone(tiny_models):
    vae = tiny_models.vae
    vae.reset()
    with torch.no_grad():
        vae.decode_block(torch.randn((1, 16, 3, 4, 6), generator=torch.Generator().manual_seed(0)))
    before = vae.snapshot()
    rm._vae_bytes_per_latent_pixel.pop(vae, None)  # force the probe to run
    vae_cache_bytes(vae, (4, 6))
    after = vae.snapshot()
    assert all(a is b for a, b in zip(before.entries, after.entries, strict=True))
    vae.reset()


def test_run_memory_counts_only_the_models_the_mode_runs(tiny_models):
    kw = dict(cache=CacheConfig("recompute"), num_blocks=3, width=48, height=32)
    cpu = torch.device("cpu")
    both = run_memory(tiny_models, mode="reward", **kw)[cpu]
    target_only = run_memory(tiny_models, mode="target-only", **kw)[cpu]
    draft_only = run_memory(tiny_models, mode="draft-only", **kw)[cpu]
    vae = 2 * vae_cache_bytes(tiny_models.vae, (4, 6))
    dit = {name: kv_cache_bytes(m, kw["cache"], 9, (4, 6)) + cross_attn_bytes(m)
           for name, m in (("target", tiny_models.target), ("drafter", tiny_models.drafter))}
    assert target_only == dit["target"] + vae and draft_only == dit["drafter"] + vae
    assert both == dit["target"] + dit["drafter"] + vae
