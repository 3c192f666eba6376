"""DiT checkpoint loading: every file format, shape faithfulness against the real 1.3B/14B, bad inputs, fp8."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sdvg.errors import ModelFileError
from sdvg.fixtures import tiny
from sdvg.loaders import wan as wl
from sdvg.loaders import wan_keys as wk

DATA = Path(__file__).resolve().parent / "data"
CFG = tiny.TINY_DRAFTER_CONFIG


def _forward(model, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 4, 6, generator=gen).to(dtype)
    ctx = torch.randn(1, 8, model.config.text_dim, generator=gen).to(dtype)
    t = torch.tensor([500.0])
    with torch.no_grad():
        return model(x, t, ctx, return_dict=False)[0].float()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return tiny.random_original_state_dict(CFG, seed=7)


@pytest.fixture(scope="module")
def formats(tmp_path_factory, weights) -> dict[str, Path]:
    """The same tiny weights in every accepted layout."""
    d = tmp_path_factory.mktemp("formats")
    meta = {wk.META_NUM_HEADS: str(CFG["num_attention_heads"])}
    pt_cfg = {"num_heads": CFG["num_attention_heads"]}
    prefixed = {"model." + k: v for k, v in weights.items()}
    other = {k: torch.zeros_like(v) for k, v in prefixed.items()}
    out = {
        "pt_ema": d / "ema.pt",
        "pt_generator": d / "gen.pth",
        "pt_plain": d / "plain.ckpt",
        "pt_legacy": d / "legacy_format.pt",
        "st_model": d / "model_prefix.safetensors",
        "st_bare": d / "bare.safetensors",
        "st_comfy": d / "comfy.safetensors",
        "st_fsdp": d / "fsdp.safetensors",
        "st_diffusers": d / "diffusers_keys.safetensors",
        "diffusers_dir": d / "diffusers",
        "diffusers_sharded": d / "pipeline_root",
        "wan_folder": d / "Wan2.1-T2V-tiny",
    }
    torch.save({"generator": other, "generator_ema": prefixed, "config": pt_cfg}, out["pt_ema"])
    torch.save({"generator": prefixed, "critic": {"x": torch.zeros(1)}, "config": pt_cfg}, out["pt_generator"])
    torch.save({**weights, "config": pt_cfg}, out["pt_plain"])
    torch.save({"generator_ema": prefixed, "config": pt_cfg}, out["pt_legacy"], _use_new_zipfile_serialization=False)
    save_file(prefixed, out["st_model"], metadata=meta)
    save_file(dict(weights), out["st_bare"], metadata=meta)
    save_file({"model.diffusion_model." + k: v for k, v in weights.items()}, out["st_comfy"], metadata=meta)
    save_file({"model._fsdp_wrapped_module." + k: v for k, v in weights.items()}, out["st_fsdp"], metadata=meta)
    diff = wk.original_to_diffusers(weights)
    save_file({k: v.contiguous() for k, v in diff.items()}, out["st_diffusers"], metadata=meta)
    model = wl.build_dit_from_state_dict(diff, CFG)
    model.save_pretrained(out["diffusers_dir"], safe_serialization=True)
    model.save_pretrained(out["diffusers_sharded"] / "transformer", safe_serialization=True, max_shard_size="200KB")
    out["wan_folder"].mkdir()  # Wan-AI's own folder: original config.json (dim, num_heads) + original keys
    dim = CFG["num_attention_heads"] * CFG["attention_head_dim"]
    wan_cfg = {"_class_name": "WanModel", "dim": dim, "num_heads": CFG["num_attention_heads"], "model_type": "t2v"}
    (out["wan_folder"] / "config.json").write_text(json.dumps(wan_cfg))
    save_file(dict(weights), out["wan_folder"] / "diffusion_pytorch_model.safetensors")
    return out


def test_format_parity(formats):
    ref = ref_sd = None
    for name, path in formats.items():
        info = wl.inspect_dit_checkpoint(path)
        assert info.config == wl.inspect_dit_checkpoint(formats["st_model"]).config, name
        model = wl.load_dit(path, dtype="fp32")
        out, sd = _forward(model), model.state_dict()
        if ref is None:
            ref, ref_sd = out, sd
        assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd), name
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=name)  # BLAS may differ by alignment
    assert torch.isfinite(ref).all() and 0 < ref.abs().max() < 100


def test_inspect_reports_layout(formats):
    ema = wl.inspect_dit_checkpoint(formats["pt_ema"])
    assert (ema.format, ema.key_layout, ema.prefix, ema.pt_key) == ("pt", "original", "model.", "generator_ema")
    assert ema.size_label == "custom: dim 64, 2 layers" and ema.dtype == "float32" and not ema.fp8
    assert wl.inspect_dit_checkpoint(formats["pt_generator"]).pt_key == "generator"
    assert wl.inspect_dit_checkpoint(formats["pt_plain"]).pt_key is None
    assert wl.inspect_dit_checkpoint(formats["st_comfy"]).prefix == "model.diffusion_model."
    assert wl.inspect_dit_checkpoint(formats["st_bare"]).prefix == ""
    assert wl.inspect_dit_checkpoint(formats["st_diffusers"]).key_layout == "diffusers"
    sharded = wl.inspect_dit_checkpoint(formats["diffusers_sharded"])
    assert sharded.format == "diffusers-dir" and len(sharded.files) > 1
    n = sum(v.numel() for v in tiny.random_original_state_dict(CFG, seed=0).values())
    assert ema.num_params == n == sharded.num_params


def test_pt_prefers_generator_ema(formats, weights):
    model = wl.load_dit(formats["pt_ema"])
    assert torch.equal(model.proj_out.weight, weights["head.head.weight"])


@pytest.mark.parametrize("size", ["1.3B", "14B"])
def test_real_size_meta_load_maps_every_key(size):
    real = json.loads((DATA / "wan21_t2v_key_shapes.json").read_text())[size]
    shapes = {"model." + k: tuple(v) for k, v in real.items()}
    src = wl._Source(Path(f"fake_{size}.safetensors"), "safetensors", [], shapes, dict.fromkeys(shapes, torch.bfloat16), {})
    info, raw_to_key = wl._inspect(src)
    assert info.size_label == size and info.config == wk.config_for_size(size) and info.prefix == "model."
    assert info.num_params == sum(torch.Size(v).numel() for v in real.values())
    sd = {raw_to_key[k]: torch.empty(s, device="meta", dtype=torch.bfloat16) for k, s in shapes.items()}
    model = wl.build_dit_from_state_dict(wk.original_to_diffusers(sd), info.config, dtype=torch.bfloat16, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert len(model.state_dict()) == len(real)


def test_assign_keeps_loaded_storage(weights):
    sd = wk.original_to_diffusers(weights)
    model = wl.build_dit_from_state_dict(sd, CFG, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert all(params[k].data_ptr() == v.data_ptr() for k, v in sd.items())


def test_fp8_storage_close_to_bf16(formats):
    bf16 = wl.load_dit(formats["st_model"], dtype="bf16")
    fp8 = wl.load_dit(formats["st_model"], dtype="fp8_e4m3fn")
    assert fp8.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    assert fp8.blocks[0].ffn.net[2].weight.dtype == torch.float8_e4m3fn
    assert fp8.patch_embedding.weight.dtype == torch.bfloat16  # skipped by layerwise casting
    assert fp8.scale_shift_table.dtype == torch.float32
    a, b = _forward(bf16, dtype=torch.bfloat16), _forward(fp8, dtype=torch.bfloat16)
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1 * a.abs().max() + 0.05


def test_keep_fp32_modules_in_half(formats):
    model = wl.load_dit(formats["st_model"], dtype="bf16")
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.scale_shift_table.dtype == torch.float32  # diffusers' _keep_in_fp32_modules


def test_write_tiny_dits(tmp_path):
    paths = tiny.write_tiny_dits(tmp_path / "a")
    again = tiny.write_tiny_dits(tmp_path / "b")
    total = 0
    for key, path in paths.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == hashlib.sha256(again[key].read_bytes()).hexdigest(), key
        total += path.stat().st_size
    assert total < 45e6  # the target is sized to cost ~15x the drafter per forward (real pair: ~10x)
    d = wl.inspect_dit_checkpoint(paths["drafter"])
    t = wl.inspect_dit_checkpoint(paths["target"])
    assert d.pt_key == "generator_ema" and d.prefix == "model." and d.config == tiny.TINY_DRAFTER_CONFIG
    assert t.format == "safetensors" and t.prefix == "model." and t.dtype == "bfloat16"
    assert t.config == tiny.TINY_TARGET_CONFIG
    assert d.config["text_dim"] == t.config["text_dim"] == tiny.TINY_TEXT_DIM
    for p in paths.values():
        out = _forward(wl.load_dit(p))
        assert torch.isfinite(out).all() and out.abs().max() < 50


# --- bad inputs ------------------------------------------------------------------------------------------


def _raises(path, *fragments):
    with pytest.raises(ModelFileError) as err:
        wl.load_dit(path)
    msg = str(err.value)
    assert str(path) in msg or os.path.basename(str(path)) in msg, msg
    for frag in fragments:
        assert frag.lower() in msg.lower(), msg
    return msg


def test_missing_file_and_folder(tmp_path):
    _raises(tmp_path / "nope.safetensors", "not found")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    _raises(tmp_path / "empty", "config.json", "readme.txt")
    (tmp_path / "unknown.gguf").write_bytes(b"GGUF")
    _raises(tmp_path / "unknown.gguf", "not a readable GGUF file")


def test_non_wan_files(tmp_path):
    vae = {f"decoder.up_blocks.{i}.conv.weight": torch.zeros(2, 2) for i in range(4)}
    vae["decoder.middle.0.residual.0.gamma"] = torch.zeros(2)
    save_file(vae, tmp_path / "vae.safetensors")
    _raises(tmp_path / "vae.safetensors", "not a Wan 2.1 DiT", "found 5 tensors", "VAE")
    t5 = {"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(2, 2), "shared.weight": torch.zeros(4, 2)}
    save_file(t5, tmp_path / "umt5.safetensors")
    _raises(tmp_path / "umt5.safetensors", "text encoder")
    torch.save({"blip.text_encoder.x": torch.zeros(1)}, tmp_path / "reward.pt")
    _raises(tmp_path / "reward.pt", "ImageReward")


def test_truncated_files(tmp_path, formats):
    for name in ("st_model", "pt_ema"):
        data = formats[name].read_bytes()
        bad = tmp_path / ("cut_" + formats[name].name)
        bad.write_bytes(data[: len(data) // 2])
        _raises(bad, "corrupt")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _Plain:
    pass


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_with_code_is_refused(tmp_path):
    torch.save({"generator_ema": {"w": torch.zeros(1)}, "obj": _Evil()}, tmp_path / "evil.pt")
    _raises(tmp_path / "evil.pt", "weights_only", "safetensors")
    torch.save({"model.x": _Plain()}, tmp_path / "obj.pth")
    _raises(tmp_path / "obj.pth", "weights_only")
    (tmp_path / "raw.ckpt").write_bytes(pickle.dumps(_Evil()))
    _raises(tmp_path / "raw.ckpt", "weights_only")


def test_unknown_prefix_missing_keys_i2v_scaled(tmp_path, weights):
    meta = {wk.META_NUM_HEADS: "2"}
    save_file({"foo.bar." + k: v for k, v in weights.items()}, tmp_path / "prefix.safetensors", metadata=meta)
    _raises(tmp_path / "prefix.safetensors", "unknown prefix", "foo.bar.")
    partial = {k: v for k, v in weights.items() if "blocks.1.ffn" not in k}
    save_file(partial, tmp_path / "partial.safetensors", metadata=meta)
    _raises(tmp_path / "partial.safetensors", "missing", "blocks.1.ffn")
    extra = dict(weights, **{"blocks.0.lora_extra.weight": torch.zeros(2)})
    save_file(extra, tmp_path / "extra.safetensors", metadata=meta)
    _raises(tmp_path / "extra.safetensors", "unexpected")
    i2v = dict(weights, **{"img_emb.proj.1.weight": torch.zeros(2, 2)})
    save_file(i2v, tmp_path / "i2v.safetensors", metadata=meta)
    _raises(tmp_path / "i2v.safetensors", "image-to-video", "T2V")
    scaled = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in weights.items()}
    scaled.update({k[: -len("weight")] + "scale_weight": torch.ones(1) for k, v in weights.items() if v.ndim == 2})
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, tmp_path / "wan_fp8_scaled.safetensors", metadata=meta)
    info = wl.inspect_dit_checkpoint(tmp_path / "wan_fp8_scaled.safetensors")
    assert info.scaled_fp8 and info.fp8 and info.quant["fp8_scaled"] > 0
    model = wl.load_dit(tmp_path / "wan_fp8_scaled.safetensors", dtype="fp32")  # loads now (tests/test_fp8_scaled.py)
    assert model.blocks[0].attn1.to_q.type_name == "fp8_scaled"


def test_plain_fp8_file_loads(tmp_path, weights):
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in weights.items()}
    save_file(fp8, tmp_path / "plain_fp8.safetensors", metadata={wk.META_NUM_HEADS: "2"})
    info = wl.inspect_dit_checkpoint(tmp_path / "plain_fp8.safetensors")
    assert info.fp8 and not info.scaled_fp8
    out = _forward(wl.load_dit(tmp_path / "plain_fp8.safetensors"))
    assert torch.isfinite(out).all()
    kept = wl.load_dit(tmp_path / "plain_fp8.safetensors", dtype="fp8_e4m3fn")
    assert kept.blocks[1].attn2.to_v.weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(kept.blocks[1].attn2.to_v.weight.float(), fp8["blocks.1.cross_attn.v.weight"].float())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth"])
def test_png_renamed_as_a_dit_is_called_a_png_image(tmp_path, suffix):
    from PIL import Image

    path = tmp_path / f"krea-realtime-video-14b{suffix}"
    Image.new("RGB", (8, 8), "red").save(path, format="PNG")
    msg = _raises(path, "this is a PNG image, not a checkpoint")
    assert "truncated" not in msg


def test_broken_link_to_a_dit_names_its_target(tmp_path):
    link = tmp_path / "self_forcing_dmd.pt"
    link.symlink_to(tmp_path / "gone" / "self_forcing_dmd.pt")
    msg = _raises(link, "is a broken symbolic link", str(tmp_path / "gone" / "self_forcing_dmd.pt"))
    assert "not found" not in msg
