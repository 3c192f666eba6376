"""Transformer-block offload on the CPU with the copy/prefetch path forced: bit-identical to the plain model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.fixtures import tiny
from sdvg.loaders import wan as wl
from sdvg.loaders.wan_keys import config_for_size
from sdvg.models.offload import SLOTS, BlockOffloader, dit_offload_plan, parse_offload, resident_blocks
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler


@pytest.fixture(scope="module")
def dits(tmp_path_factory):
    return tiny.write_tiny_dits(tmp_path_factory.mktemp("offload-dits"))


def _calls(model, seed: int = 0):
    """Cross-attention prep, a cached block, a second block attending to it, a no-write re-run and a masked
    forward: every path that iterates the blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 4, 6, generator=gen)
    emb = torch.randn(1, 7, model.config.text_dim, generator=gen)
    t = torch.full((1, 3), 700.0)
    cross = model.prepare_cross_attention(emb)
    kv = model.new_kv_cache(batch=1, latent_hw=(4, 6), capacity_frames=6)
    out = [model.forward_block(x, t, kv, cross), model.forward_block(x * 0.5, t, kv, cross, frame_offset=3),
           model.forward_block(x, t, kv, cross, frame_offset=3, write=False),
           model.forward_blockwise_masked(torch.cat([x, x], 2), torch.full((1, 6), 300.0), cross)]
    return [*cross.k, *cross.v, *out, kv.layer(1)[0]]


@pytest.mark.parametrize("resident", [0, 2])
def test_offloaded_target_is_bit_identical(dits, resident):
    plain = wl.load_dit(dits["target"], dtype="fp32")
    off = wl.load_dit(dits["target"], dtype="fp32", offload_blocks=resident)
    offloader = off.block_offloader
    assert isinstance(offloader, BlockOffloader) and offloader.resident == resident
    assert offloader.streamed == len(off.blocks) - resident
    stored = [p.data_ptr() for p in off.blocks[-1].parameters()]
    for a, b in zip(_calls(plain), _calls(off), strict=True):
        assert torch.equal(a, b)
    # between forwards the streamed blocks point at their storage again, not at a slot
    assert [p.data_ptr() for p in off.blocks[-1].parameters()] == stored
    assert offloader.device_bytes() == (resident + SLOTS) * offloader.block_bytes


def test_moving_an_offloaded_model_keeps_the_streamed_blocks_in_storage(dits):
    from sdvg.models.offload import move_model

    plain = wl.load_dit(dits["target"], dtype="fp32")
    off = wl.load_dit(dits["target"], dtype="fp32", offload_blocks=1)
    stored = [p.data_ptr() for p in off.blocks[3].parameters()]
    _calls(off)
    move_model(off, "cpu")  # what a host's model manager calls; the slots are rebuilt on the new device
    assert off.block_offloader._slots is None
    assert [p.data_ptr() for p in off.blocks[3].parameters()] == stored
    for a, b in zip(_calls(plain), _calls(off), strict=True):
        assert torch.equal(a, b)


def test_an_interrupted_forward_leaves_every_block_in_its_storage(dits):
    off = wl.load_dit(dits["target"], dtype="fp32", offload_blocks=1)
    stored = {i: [p.data_ptr() for p in blk.parameters()] for i, blk in enumerate(off.blocks) if i >= 1}
    for i, _ in off.iter_blocks():
        if i == 2:
            break
    assert {i: [p.data_ptr() for p in off.blocks[i].parameters()] for i in stored} == stored


def test_fp8_weights_offloaded_stay_identical_and_caches_stay_bf16(dits):
    plain = wl.load_dit(dits["drafter"], dtype="fp8_e4m3fn")
    off = wl.load_dit(dits["drafter"], dtype="fp8_e4m3fn", offload_blocks=0)
    assert off.blocks[1].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    kv = off.new_kv_cache(batch=1, latent_hw=(4, 6), capacity_frames=3)
    assert kv.layer(0)[0].dtype == torch.bfloat16 and off.compute_dtype == torch.bfloat16
    for a, b in zip(_calls(plain), _calls(off), strict=True):
        assert torch.equal(a, b)


def test_a_whole_run_with_an_offloaded_target_is_bit_identical(tiny_dir, tiny_models):
    target = wl.load_dit(next((tiny_dir / "diffusion_models").glob("sdvg_tiny_target*")), dtype="fp32",
                         offload_blocks=1)
    models = dataclasses.replace(tiny_models, target=target)
    cfg = SamplerConfig(num_blocks=2, width=32, height=32, seed=1)
    router = RouterConfig(mode="target-only")
    a = SpeculativeSampler(tiny_models, router, cfg).run("a fox")
    b = SpeculativeSampler(models, router, cfg).run("a fox")
    assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)


def test_offload_settings():
    assert parse_offload(None) is None and parse_offload("none") is None and parse_offload(" Auto ") == "auto"
    assert parse_offload("12") == 12
    for bad in ("-1", "two", -3, 1.5, True):
        with pytest.raises(ConfigError, match="resident blocks"):
            parse_offload(bad)
    kw = {"num_blocks": 40, "block_bytes": 10, "other_bytes": 100, "device": torch.device("cpu"), "reserve_bytes": 0}
    assert resident_blocks(99, **kw) == 40
    # auto: floor((free·0.95 − reserve − other − 2 slots) / block)
    assert resident_blocks("auto", **kw, free=500) == math.floor((475 - 100 - 20) / 10) == 35
    assert resident_blocks("auto", **{**kw, "reserve_bytes": 900}, free=1000) == 0


def test_the_14b_fp8_offload_plan_adds_up():
    cfg = config_for_size("14B")
    params = 14_288_491_584  # the released 14B (checked in test_wan_keys against the real shapes)
    k, need, block = dit_offload_plan(cfg, params, 1, 8, torch.device("cpu"))
    assert k == 8 and block == 351_394_304
    assert need == params - 40 * block + (8 + SLOTS) * block
    assert dit_offload_plan(cfg, params, 1, None, torch.device("cpu"))[1] == params
