"""Causal Wan DiT forward and the preallocated KV cache on tiny random configs (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from sdvg.dit import CausalWanTransformer, sinusoidal_embedding
from sdvg.errors import ConfigError
from sdvg.kv_cache import SelfKVCache, kv_cache_nbytes

CFG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
)


def _model(seed: int = 0) -> CausalWanTransformer:
    torch.manual_seed(seed)
    m = CausalWanTransformer(**CFG).eval()
    with torch.no_grad():  # make the modulation tables matter
        for p in m.parameters():
            if p.ndim == 3:
                p.normal_(0, 0.5)
    return m


@pytest.fixture(scope="module")
def model() -> CausalWanTransformer:
    return _model()


@pytest.fixture(scope="module")
def cross(model):
    torch.manual_seed(1)
    return model.prepare_cross_attention(torch.randn(1, 7, 32))


def _t(values, frames_per_block=3):
    return torch.tensor([[float(v) for v in values for _ in range(frames_per_block)]])


def test_config_and_state_dict_roundtrip():
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**CFG).eval()
    m = CausalWanTransformer.from_config(ref.config).eval()
    m.load_state_dict(ref.state_dict())
    assert isinstance(m, WanTransformer3DModel)
    x, ctx = torch.randn(1, 16, 3, 8, 8), torch.randn(1, 7, 32)
    with torch.no_grad():
        expected = ref(x, torch.tensor([500.0]), ctx, return_dict=False)[0]
    got = m.forward_block(x, torch.full((1, 3), 500.0), None, m.prepare_cross_attention(ctx))
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_sinusoid_matches_diffusers_layout():
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0.0, 357.14, 1000.0])
    ours = sinusoidal_embedding(t, 32)
    assert ours.dtype == torch.float64
    ref = get_timestep_embedding(t, 32, flip_sin_to_cos=True, downscale_freq_shift=0)
    torch.testing.assert_close(ours.float(), ref, atol=2e-4, rtol=0)


def test_cache_equivalence_with_masked_forward(model, cross):
    torch.manual_seed(2)
    x = torch.randn(1, 16, 9, 8, 8)
    t = _t([0.0, 625.0, 937.5])
    full = model.forward_blockwise_masked(x, t, cross, frames_per_block=3)
    kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=9)
    outs = [model.forward_block(x[:, :, f:f + 3], t[:, f:f + 3], kv, cross, frame_offset=f) for f in (0, 3, 6)]
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-5, rtol=1e-5)
    # the batch recompute path writes identical K/V
    kv2 = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=9)
    model.forward_blockwise_masked(x, t, cross, 3, self_kv=kv2)
    torch.testing.assert_close(kv2.k, kv.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv2.v, kv.v, atol=1e-5, rtol=1e-5)


def test_rope_offset_changes_output_but_is_relative(model, cross):
    torch.manual_seed(3)
    x = torch.randn(1, 16, 3, 8, 8)
    t = torch.full((1, 3), 500.0)
    a = model.forward_block(x, t, None, cross, frame_offset=0)
    b = model.forward_block(x, t, None, cross, frame_offset=5)
    # self-attention within one block only sees relative positions: the offset cancels out
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    ctx, blk = torch.randn(1, 16, 3, 8, 8), x
    outs = []
    for off in (0, 7):
        kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
        model.forward_block(ctx, torch.zeros(1, 3), kv, cross, frame_offset=off)
        outs.append(model.forward_block(blk, t, kv, cross, frame_offset=off + 3))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_write_false_and_same_slot_overwrite(model, cross):
    torch.manual_seed(4)
    kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
    x0, x1 = torch.randn(1, 16, 3, 8, 8), torch.randn(1, 16, 3, 8, 8)
    model.forward_block(x0, torch.zeros(1, 3), kv, cross, frame_offset=0)
    snap_k, snap_v = kv.k.clone(), kv.v.clone()
    ro = model.forward_block(x1, torch.full((1, 3), 900.0), kv, cross, frame_offset=3, write=False)
    assert torch.equal(kv.k, snap_k) and torch.equal(kv.v, snap_v) and kv.frames == [0, 1, 2]
    rw = model.forward_block(x1, torch.full((1, 3), 900.0), kv, cross, frame_offset=3)
    torch.testing.assert_close(ro, rw, atol=1e-6, rtol=1e-6)
    assert kv.frames == [0, 1, 2, 3, 4, 5]
    again = model.forward_block(x1, torch.full((1, 3), 900.0), kv, cross, frame_offset=3)
    torch.testing.assert_close(again, rw, atol=1e-6, rtol=1e-6)
    assert kv.frames == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError):
        model.forward_block(x1, torch.zeros(1, 3), kv, cross, frame_offset=6)  # global cache is full


def test_fused_projections_match():
    m = _model(5)
    torch.manual_seed(6)
    ctx, x = torch.randn(1, 7, 32), torch.randn(1, 16, 3, 8, 8)
    t = torch.full((1, 3), 700.0)
    ref = m.forward_block(x, t, None, m.prepare_cross_attention(ctx))
    for blk in m.blocks:
        blk.attn1.fuse_projections()
        blk.attn2.fuse_projections()
    got = m.forward_block(x, t, None, m.prepare_cross_attention(ctx))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_per_frame_timesteps_are_per_frame(model, cross):
    torch.manual_seed(7)
    x = torch.randn(1, 16, 1, 8, 8)
    single = model.forward_block(x, torch.full((1, 1), 250.0), None, cross)
    mixed = model.forward_block(torch.cat([x, x], 2), torch.tensor([[250.0, 800.0]]), None, cross)
    same = model.forward_block(torch.cat([x, x], 2), torch.tensor([[250.0, 250.0]]), None, cross)
    assert not torch.allclose(mixed[:, :, 0], same[:, :, 0], atol=1e-4)  # frame 1's t reaches frame 0 via attention
    assert single.shape == (1, 16, 1, 8, 8)
    with pytest.raises(ConfigError):
        model.forward_block(x, torch.full((1, 2), 250.0), None, cross)


def _marked_cache(**kw) -> SelfKVCache:
    return SelfKVCache(num_layers=2, batch=1, tokens_per_frame=2, heads=1, head_dim=1, **kw)


def _write(cache: SelfKVCache, frame: int, n: int = 3) -> None:
    slots = cache.begin_write(frame, n)
    vals = torch.arange(frame, frame + n, dtype=torch.float32).repeat_interleave(cache.tokens_per_frame)
    cache.k[:, :, slots.start:slots.end] = vals.view(1, 1, -1, 1, 1)
    cache.v[:, :, slots.start:slots.end] = -vals.view(1, 1, -1, 1, 1)


def _slot_frames(cache: SelfKVCache) -> list[int]:
    tok = cache.k[0, 0, : cache.filled_tokens, 0, 0]
    return [int(v) for v in tok[:: cache.tokens_per_frame]]


def test_rolling_window_evicts_and_keeps_sinks():
    cache = _marked_cache(capacity_frames=12, rolling=True, sink_frames=3)
    ptr = (cache.k.data_ptr(), cache.v.data_ptr())
    for b in range(4):
        _write(cache, 3 * b)
    assert cache.frames == list(range(12)) == _slot_frames(cache)
    _write(cache, 12)
    assert cache.frames == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14] == _slot_frames(cache)
    _write(cache, 15)
    _write(cache, 18)
    expected = [0, 1, 2, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert cache.frames == expected == _slot_frames(cache)
    assert torch.equal(cache.v, -cache.k)
    assert (cache.k[1] == cache.k[0]).all()  # every layer shifted
    _write(cache, 18)  # re-run the newest block: same slots
    assert cache.frames == expected
    with pytest.raises(ConfigError):
        cache.begin_write(6, 3)  # evicted
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptr
    small = _marked_cache(capacity_frames=5, rolling=True, sink_frames=1)
    _write(small, 0)
    _write(small, 3)  # needs 1 slot: evicts frame 1, keeps sink 0
    assert small.frames == [0, 2, 3, 4, 5] == _slot_frames(small)
    _write(small, 6)
    assert small.frames == [0, 5, 6, 7, 8] == _slot_frames(small)


def test_reset_and_nbytes():
    cache = _marked_cache(capacity_frames=6)
    _write(cache, 0)
    cache.reset()
    assert cache.frames == [] and cache.filled_tokens == 0
    _write(cache, 0)
    assert cache.frames == [0, 1, 2]
    assert cache.nbytes == 2 * 2 * 6 * 2 * 1 * 1 * 4
    assert kv_cache_nbytes(num_layers=2, capacity_frames=6, tokens_per_frame=2, heads=1, head_dim=1,
                           dtype=torch.float32) == cache.nbytes
    big = kv_cache_nbytes(num_layers=30, capacity_frames=21, tokens_per_frame=1560, heads=12, head_dim=128)
    assert round(big / 1e9, 1) == 6.0
    with pytest.raises(ConfigError):
        _marked_cache(capacity_frames=3, rolling=True, sink_frames=3)
