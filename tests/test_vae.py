"""StreamingVAE: streaming decode == full decode, snapshot/restore semantics, constant per-block cost, loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors import safe_open
from safetensors.torch import save_file

from sdvg.errors import ConfigError, ModelFileError
from sdvg.vae import (
    TINY_VAE_CONFIG,
    StreamingVAE,
    VAEState,
    build_tiny_vae_model,
    latent_to_pixel_frames,
    wan_vae_to_original_keys,
    write_tiny_vae,
)

H = W = 2  # latent size of most tests: 16x16 pixels keeps the suite fast


def _lat(seed: int, f: int = 3, h: int = H, w: int = W) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, f, h, w, generator=g)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("models"))


@pytest.fixture()
def vae(tiny_path):
    return StreamingVAE.load(tiny_path, device="cpu", dtype="fp32")


def _unnormalize(vae: StreamingVAE, z: torch.Tensor) -> torch.Tensor:
    cfg = vae.model.config
    mean = torch.tensor(cfg.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, 16, 1, 1, 1)
    return z * std + mean


# ---- tiny file and key layouts ------------------------------------------------------------------------------

def test_inverse_key_mapping_roundtrips_through_diffusers():
    sd = build_tiny_vae_model().state_dict()
    original = wan_vae_to_original_keys(sd)
    back = convert_wan_vae_to_diffusers(dict(original))
    assert set(back) == set(sd)
    assert all(back[k] is sd[k] for k in sd)
    # Layout of the real Comfy-Org / Wan-AI files.
    for key in ("encoder.conv1.weight", "decoder.conv1.weight", "decoder.middle.0.residual.0.gamma",
                "decoder.middle.1.to_qkv.weight", "decoder.head.2.weight", "conv1.weight", "conv2.weight",
                "decoder.upsamples.3.resample.1.weight", "decoder.upsamples.3.time_conv.weight",
                "decoder.upsamples.4.shortcut.weight", "decoder.upsamples.14.residual.6.weight",
                "encoder.downsamples.5.time_conv.weight"):
        assert key in original, key


def test_tiny_file_is_small_original_keyed_and_deterministic(tiny_path, tmp_path):
    assert tiny_path.name == "sdvg_tiny_vae.safetensors" and tiny_path.parent.name == "vae"
    assert tiny_path.stat().st_size < 2_000_000
    with safe_open(str(tiny_path), "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert "decoder.middle.0.residual.0.gamma" in keys and "conv2.weight" in keys
    assert json.loads(meta["sdvg_config"]) == TINY_VAE_CONFIG
    again = write_tiny_vae(tmp_path)  # same seed, same tensors (header order may differ: metadata is a map)
    with safe_open(str(tiny_path), "pt") as f, safe_open(str(again), "pt") as g:
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in keys)


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
    assert vae.snapshot_nbytes(state) == state.nbytes == vae.cache_nbytes > 0


def test_restore_rejects_foreign_state(vae, tiny_path):
    other = StreamingVAE.load(tiny_path, device="cpu", dtype="fp32")
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


# ---- loaders --------------------------------------------------------------------------------------------------

def test_all_load_formats_give_identical_outputs(vae, tiny_path, tmp_path):
    with safe_open(str(tiny_path), "pt") as f:
        original = {k: f.get_tensor(k) for k in f.keys()}
    pth = tmp_path / "Wan2.1_VAE.pth"
    torch.save(original, pth)
    folder = tmp_path / "diffusers_vae"
    vae.model.save_pretrained(folder)
    flat = tmp_path / "diffusers_keys.safetensors"
    save_file({k: v.contiguous() for k, v in vae.model.state_dict().items()}, str(flat))
    pipeline_dir = tmp_path / "pipeline"
    vae.model.save_pretrained(pipeline_dir / "vae")

    z0, z1 = _lat(40, f=2), _lat(41, f=1)
    ref = [vae.decode_block(z0), vae.decode_block(z1)]
    for path in (pth, folder, flat, pipeline_dir):
        other = StreamingVAE.load(path, device="cpu", dtype=torch.float32)
        out = [other.decode_block(z0), other.decode_block(z1)]
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True)), path


def test_reduced_precision_weights_and_input_casting(tiny_path):
    for dt in ("bf16", "fp16"):
        v = StreamingVAE.load(tiny_path, device="cpu", dtype=dt)
        assert v.dtype == next(v.model.parameters()).dtype != torch.float32
        out = v.decode_block(_lat(0, h=2, w=2).double())
        assert out.dtype == torch.float32 and out.shape == (9, 16, 16, 3)
        assert torch.isfinite(out).all()


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


def _fake(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_bad_files_raise_model_file_error_naming_the_file(tmp_path, tiny_path):
    data = tiny_path.read_bytes()
    truncated = tmp_path / "truncated_vae.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    truncated_pth = tmp_path / "truncated_vae.pth"
    with safe_open(str(tiny_path), "pt") as f:
        torch.save({k: f.get_tensor(k) for k in f.keys()}, truncated_pth)
    truncated_pth.write_bytes(truncated_pth.read_bytes()[:5000])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a safetensors file" * 10)
    dit = _fake(tmp_path / "wan2.1_t2v_1.3B.safetensors",
                {"head.modulation": torch.zeros(1, 2, 4), "blocks.0.self_attn.q.weight": torch.zeros(4, 4),
                 "patch_embedding.weight": torch.zeros(4, 16, 1, 2, 2)})
    te = _fake(tmp_path / "umt5_xxl.safetensors",
               {"shared.weight": torch.zeros(8, 4), "encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)})
    wan22 = _fake(tmp_path / "wan2.2_vae.safetensors",
                  {"decoder.middle.0.residual.0.gamma": torch.ones(4, 1, 1, 1), "conv2.weight": torch.zeros(48, 48, 1, 1, 1),
                   "decoder.upsamples.0.upsamples.0.residual.2.weight": torch.zeros(4, 4, 3, 3, 3)})
    unsafe = tmp_path / "training_state.pth"
    torch.save({"generator_ema": {"x": torch.zeros(1)}, "step": 3}, unsafe)
    folder = tmp_path / "empty_folder"
    folder.mkdir()
    cases = {
        tmp_path / "missing_vae.safetensors": "not found",
        truncated: "truncated|corrupt",
        truncated_pth: "truncated|corrupt",
        garbage: "truncated|corrupt",
        dit: "DiT",
        te: "text encoder",
        wan22: "Wan 2.2",
        unsafe: "non-tensor",
        folder: "config.json",
    }
    for path, pattern in cases.items():
        with pytest.raises(ModelFileError, match=pattern) as info:
            StreamingVAE.load(path, device="cpu", dtype="fp32")
        assert path.name in str(info.value), str(info.value)


def test_bad_dtype_and_device(tiny_path):
    with pytest.raises(ConfigError):
        StreamingVAE.load(tiny_path, device="cpu", dtype="fp8_e4m3fn")
    with pytest.raises(ConfigError):
        StreamingVAE.load(tiny_path, device="cpu", dtype="int4")


def test_real_wan21_layout_is_inferred_from_shapes():
    """The full-size Wan 2.1 VAE (built on the meta device) round-trips through both key layouts."""
    from sdvg.vae import _build_model, _infer_config

    with torch.device("meta"):
        real = AutoencoderKLWan()
    original = wan_vae_to_original_keys(real.state_dict())
    assert len(original) == 194  # as in Comfy-Org's wan_2.1_vae.safetensors / Wan2.1_VAE.pth
    cfg = _infer_config(convert_wan_vae_to_diffusers(dict(original)))
    assert cfg["base_dim"] == 96 and cfg["dim_mult"] == [1, 2, 4, 4] and cfg["num_res_blocks"] == 2
    assert cfg["temperal_downsample"] == [False, True, True] and cfg["z_dim"] == 16
    model = _build_model(Path("wan_2.1_vae.safetensors"), convert_wan_vae_to_diffusers(dict(original)), None)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in real.parameters())


def test_wan22_vae_in_diffusers_layout_is_refused(tmp_path):
    with torch.device("meta"):
        m22 = AutoencoderKLWan(base_dim=4, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                               patch_size=2, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    sd = {k: torch.zeros(v.shape) for k, v in m22.state_dict().items()}
    flat = _fake(tmp_path / "wan2.2_vae_diffusers.safetensors", sd)
    folder = tmp_path / "Wan2.2-TI2V-5B-Diffusers"
    (folder / "vae").mkdir(parents=True)
    save_file(sd, str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    (folder / "vae" / "config.json").write_text(json.dumps(
        {"_class_name": "AutoencoderKLWan", "z_dim": 48, "is_residual": True, "base_dim": 4}))
    for path in (flat, folder):
        with pytest.raises(ModelFileError, match="Wan 2.2") as info:
            StreamingVAE.load(path, device="cpu", dtype="fp32")
        assert path.name in str(info.value)


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
