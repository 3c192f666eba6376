"""StreamingVAE: streaming decode == full decode, snapshot/restore semantics, constant per-block cost, encode."""

from __future__ import annotations

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.loaders.vae import load_streaming_vae
from sdvg.models.vae import StreamingVAE, VAEState, latent_to_pixel_frames
from tests.inputs import latents as _lat

H = W = 2  # latent size of most tests: 16x16 pixels keeps the suite fast


@pytest.fixture()
def vae(tiny_vae_path):
    return load_streaming_vae(tiny_vae_path, device="cpu", dtype="fp32")


def _unnormalize(vae: StreamingVAE, z: torch.Tensor) -> torch.Tensor:
    cfg = vae.model.config
    mean = torch.tensor(cfg.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, 16, 1, 1, 1)
    return z * std + mean


def test_latent_to_pixel_frames():
    assert [latent_to_pixel_frames(n) for n in (0, 1, 3, 21)] == [0, 1, 9, 81]


# ---- streaming decode ---------------------------------------------------------------------------------------

def test_streaming_decode_equals_full_decode(vae):
    blocks = [_lat(i) for i in range(3)]
    frames = torch.cat([vae.decode_block(b) for b in blocks])
    full = vae.model.decode(_unnormalize(vae, torch.cat(blocks, dim=2))).sample  # [1,3,T,H,W] in [-1,1]
    ref = ((full[0].clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0)
    assert frames.shape == ref.shape == (latent_to_pixel_frames(9), 8 * H, 8 * W, 3)
    torch.testing.assert_close(frames, ref, rtol=0, atol=1e-5)
    assert frames.dtype == torch.float32 and frames.min() >= 0 and frames.max() <= 1
    assert frames.std() > 0.01  # not a constant image


def test_frame_counts_9_then_12_and_reset(vae):
    assert vae.decode_block(_lat(0)).shape[0] == 9
    assert vae.decode_block(_lat(1)).shape[0] == 12
    assert vae.decode_block(_lat(2)).shape[0] == 12
    assert vae.frames_decoded == 9
    vae.reset()
    assert vae.pixel_frames_for(3) == 9
    assert vae.decode_block(_lat(3)).shape[0] == 9
    assert vae.pixel_frames_for(3) == 12


def test_single_frame_chunks_equal_block_decode(vae):
    z = _lat(5)
    whole = vae.decode_block(z)
    vae.reset()
    parts = torch.cat([vae.decode_block(z[:, :, i:i + 1]) for i in range(3)])
    # Same arithmetic per frame, but post_quant_conv over 1 vs 3 frames picks different conv kernels; the
    # 2-channel tiny decoder's RMS norms amplify that float rounding to ~3e-4.
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-3)


# ---- snapshot / restore -------------------------------------------------------------------------------------

def test_restore_after_draft_is_bit_exact_to_never_decoding_it(vae):
    a, draft, b, c = _lat(10), _lat(11), _lat(12), _lat(13)
    vae.decode_block(a)
    state = vae.snapshot()
    draft_frames = vae.decode_block(draft)
    vae.restore(state)
    out_b = vae.decode_block(b)
    vae.restore(state)                      # a state can be restored more than once
    out_b2 = vae.decode_block(b)
    out_c = vae.decode_block(c)

    vae.reset()
    vae.decode_block(a)
    ref_b = vae.decode_block(b)
    ref_c = vae.decode_block(c)
    assert torch.equal(out_b, ref_b) and torch.equal(out_b2, ref_b) and torch.equal(out_c, ref_c)
    assert not torch.equal(draft_frames, ref_b)


def test_snapshot_holds_references_and_decoder_never_mutates_entries(vae):
    vae.decode_block(_lat(20))
    vae.decode_block(_lat(21))
    state = vae.snapshot()
    tensors = [e for e in state.entries if torch.is_tensor(e)]
    # Every cached conv holds a tensor after two blocks; only 1x1x1 shortcut convs never use the cache.
    assert len(tensors) >= len(state.entries) - 1 and all(e is None or torch.is_tensor(e) for e in state.entries)
    live = vae._cache
    assert all(s is e for s, e in zip(state.entries, live, strict=True))
    assert all(s.data_ptr() == e.data_ptr() for s, e in zip(state.entries, live, strict=True) if s is not None)
    versions = [t._version for t in tensors]
    copies = [t.clone() for t in tensors]
    vae.decode_block(_lat(22))
    vae.decode_block(_lat(23))
    assert [t._version for t in tensors] == versions
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies, strict=True))
    assert all(a is not b for a, b in zip(tensors, (e for e in vae._cache if e is not None), strict=True))  # replaced
    assert state.nbytes == vae.cache_nbytes > 0  # a snapshot references the live cache: no extra memory


def test_restore_rejects_foreign_state(vae, tiny_vae_path):
    other = load_streaming_vae(tiny_vae_path, device="cpu", dtype="fp32")
    with pytest.raises(ConfigError):
        vae.restore(other.snapshot())
    with pytest.raises(ConfigError):
        vae.restore("not a state")  # type: ignore[arg-type]
    assert isinstance(vae.snapshot(), VAEState)


# ---- constant per-block cost ----------------------------------------------------------------------------------

def test_cache_size_and_conv_calls_constant_over_blocks(vae):
    calls = [0]

    def hook(*_):
        calls[0] += 1

    handles = [m.register_forward_hook(hook) for m in vae.model.decoder.modules()
               if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d))]
    try:
        per_block, shapes, nbytes = [], [], []
        for blk in range(6):
            calls[0] = 0
            vae.decode_block(_lat(30 + blk))
            per_block.append(calls[0])
            shapes.append([tuple(e.shape) if torch.is_tensor(e) else e for e in vae._cache])
            nbytes.append(vae.cache_nbytes)
    finally:
        for h in handles:
            h.remove()
    assert len(set(per_block[1:])) == 1 and per_block[1] > 0
    assert all(s == shapes[1] for s in shapes[1:])
    assert len(set(nbytes[1:])) == 1
    assert len(vae._cache) == vae.model._cached_conv_counts["decoder"]


# ---- encode ---------------------------------------------------------------------------------------------------

def test_encode_frame_shape_determinism_and_reference(vae):
    img = torch.rand(1, 8 * H, 8 * W, 3, generator=torch.Generator().manual_seed(0))
    z1 = vae.encode_frame(img)
    z2 = vae.encode_frame(img)
    assert z1.shape == (1, 16, 1, H, W) and z1.dtype == torch.float32
    assert torch.equal(z1, z2)
    x = img.permute(0, 3, 1, 2).unsqueeze(2) * 2 - 1
    mu = vae.model.encode(x).latent_dist.mode()
    cfg = vae.model.config
    ref = (mu - torch.tensor(cfg.latents_mean).view(1, 16, 1, 1, 1)) / torch.tensor(cfg.latents_std).view(
        1, 16, 1, 1, 1)
    torch.testing.assert_close(z1, ref, rtol=0, atol=1e-5)
    # Encoding does not disturb the decoder stream.
    vae.decode_block(_lat(1))
    state = vae.snapshot()
    vae.encode_frame(img)
    assert all(a is b for a, b in zip(state.entries, vae._cache, strict=True))


def test_encode_frame_rejects_bad_images(vae):
    for bad in (torch.rand(32, 32, 3), torch.rand(1, 3, 32, 32), torch.rand(2, 32, 32, 3), torch.rand(1, 30, 32, 3)):
        with pytest.raises(ConfigError):
            vae.encode_frame(bad)


# ---- errors ---------------------------------------------------------------------------------------------------

def test_bad_latents_raise_config_error(vae):
    cases = {
        "4 dims": torch.randn(16, 3, H, W),
        "48 channels": torch.randn(1, 48, 3, H, W),
        "batch 2": torch.randn(2, 16, 3, H, W),
        "ints": torch.zeros(1, 16, 3, H, W, dtype=torch.int64),
    }
    for name, bad in cases.items():
        with pytest.raises(ConfigError, match=r"latent|float|batch|channels|dims"):
            vae.decode_block(bad)
        assert vae.frames_decoded == 0, name
    vae.decode_block(_lat(0))
    with pytest.raises(ConfigError, match="reset"):
        vae.decode_block(_lat(1, h=H + 1))


def test_failed_decode_leaves_stream_untouched(vae):
    vae.decode_block(_lat(50))
    before = vae.snapshot()
    calls = [0]

    def boom(*_):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated out of memory")

    handle = vae.model.decoder.conv_out.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            vae.decode_block(_lat(51))
    finally:
        handle.remove()
    assert vae.frames_decoded == before.frames_decoded
    assert all(a is b for a, b in zip(before.entries, vae._cache, strict=True))
    out = vae.decode_block(_lat(51))
    vae.restore(before)
    assert torch.equal(out, vae.decode_block(_lat(51)))


# ---- latent normalization (public; the ComfyUI LATENT output uses it) ---------------------------------------

def test_denormalize_matches_config_stats_and_normalize_inverts_it(vae):
    z = _lat(11)
    raw = vae.denormalize(z)
    assert raw.dtype == torch.float32 and raw.device == z.device and raw.shape == z.shape
    assert torch.equal(raw, _unnormalize(vae, z))
    torch.testing.assert_close(vae.normalize(raw), z, rtol=0, atol=1e-5)
    assert torch.equal(vae.denormalize(z.to(torch.bfloat16)), _unnormalize(vae, z.to(torch.bfloat16).float()))
    assert torch.equal(z, _lat(11))  # input untouched


def test_decode_block_is_the_raw_vae_decode_of_denormalize(vae):
    z = _lat(12)
    frames = vae.decode_block(z)
    ref = vae.model.decode(vae.denormalize(z)).sample
    ref = ((ref[0].clamp(-1, 1) + 1) * 0.5).permute(1, 2, 3, 0)
    torch.testing.assert_close(frames, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [torch.zeros(1, 8, 3, 4, 4), torch.zeros(16, 3, 4, 4)])
def test_denormalize_rejects_wrong_shapes(vae, bad):
    with pytest.raises(ConfigError, match="16"):
        vae.denormalize(bad)
    with pytest.raises(ConfigError, match="16"):
        vae.normalize(bad)
