"""Wan 2.1 VAE files: key layouts, config from shapes, every load format, and clear errors for wrong files."""

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
from sdvg.fixtures.tiny import TINY_VAE_CONFIG, build_tiny_vae_model, write_tiny_vae
from sdvg.loaders.vae import load_streaming_vae, wan_vae_to_original_keys
from tests.inputs import latents as _lat


@pytest.fixture()
def vae(tiny_vae_path):
    return load_streaming_vae(tiny_vae_path, device="cpu", dtype="fp32")


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


def test_tiny_file_is_small_original_keyed_and_deterministic(tiny_vae_path, tmp_path):
    assert tiny_vae_path.name == "sdvg_tiny_vae.safetensors" and tiny_vae_path.parent.name == "vae"
    assert tiny_vae_path.stat().st_size < 2_000_000
    with safe_open(str(tiny_vae_path), "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert "decoder.middle.0.residual.0.gamma" in keys and "conv2.weight" in keys
    assert json.loads(meta["sdvg_config"]) == TINY_VAE_CONFIG
    again = write_tiny_vae(tmp_path)  # same seed, same tensors (header order may differ: metadata is a map)
    with safe_open(str(tiny_vae_path), "pt") as f, safe_open(str(again), "pt") as g:
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in keys)


def test_all_load_formats_give_identical_outputs(vae, tiny_vae_path, tmp_path):
    with safe_open(str(tiny_vae_path), "pt") as f:
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
        other = load_streaming_vae(path, device="cpu", dtype=torch.float32)
        out = [other.decode_block(z0), other.decode_block(z1)]
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True)), path


def test_reduced_precision_weights_and_input_casting(tiny_vae_path):
    for dt in ("bf16", "fp16"):
        v = load_streaming_vae(tiny_vae_path, device="cpu", dtype=dt)
        assert v.dtype == next(v.model.parameters()).dtype != torch.float32
        out = v.decode_block(_lat(0, h=2, w=2).double())
        assert out.dtype == torch.float32 and out.shape == (9, 16, 16, 3)
        assert torch.isfinite(out).all()


def _fake(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_bad_files_raise_model_file_error_naming_the_file(tmp_path, tiny_vae_path):
    data = tiny_vae_path.read_bytes()
    truncated = tmp_path / "truncated_vae.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    truncated_pth = tmp_path / "truncated_vae.pth"
    with safe_open(str(tiny_vae_path), "pt") as f:
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
            load_streaming_vae(path, device="cpu", dtype="fp32")
        assert path.name in str(info.value), str(info.value)


def test_bad_dtype_and_device(tiny_vae_path):
    with pytest.raises(ConfigError):
        load_streaming_vae(tiny_vae_path, device="cpu", dtype="fp8_e4m3fn")
    with pytest.raises(ConfigError):
        load_streaming_vae(tiny_vae_path, device="cpu", dtype="int4")


def test_real_wan21_layout_is_inferred_from_shapes():
    """The full-size Wan 2.1 VAE (built on the meta device) round-trips through both key layouts."""
    from sdvg.loaders.vae import build_vae_model, infer_vae_config

    with torch.device("meta"):
        real = AutoencoderKLWan()
    original = wan_vae_to_original_keys(real.state_dict())
    assert len(original) == 194  # as in Comfy-Org's wan_2.1_vae.safetensors / Wan2.1_VAE.pth
    cfg = infer_vae_config(convert_wan_vae_to_diffusers(dict(original)))
    assert cfg["base_dim"] == 96 and cfg["dim_mult"] == [1, 2, 4, 4] and cfg["num_res_blocks"] == 2
    assert cfg["temperal_downsample"] == [False, True, True] and cfg["z_dim"] == 16
    model = build_vae_model(Path("wan_2.1_vae.safetensors"), convert_wan_vae_to_diffusers(dict(original)), None)
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
            load_streaming_vae(path, device="cpu", dtype="fp32")
        assert path.name in str(info.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth"])
def test_png_renamed_as_a_vae_is_called_a_png_image(tmp_path, suffix):
    from PIL import Image

    path = tmp_path / f"wan_2.1_vae{suffix}"
    Image.new("RGB", (8, 8), "red").save(path, format="PNG")
    with pytest.raises(ModelFileError, match="this is a PNG image, not a checkpoint") as err:
        load_streaming_vae(path, device="cpu")
    assert str(path) in str(err.value) and "truncated" not in str(err.value)


def test_broken_link_to_a_vae_names_its_target(tmp_path):
    link = tmp_path / "wan_2.1_vae.safetensors"
    link.symlink_to(tmp_path / "old" / "wan_2.1_vae.safetensors")
    with pytest.raises(ModelFileError, match="is a broken symbolic link") as err:
        load_streaming_vae(link, device="cpu")
    assert str(tmp_path / "old" / "wan_2.1_vae.safetensors") in str(err.value)
    assert "not found" not in str(err.value)
