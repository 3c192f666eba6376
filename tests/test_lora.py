"""LoRAs merged at load time: every accepted layout equals a hand merge, strengths add, bad files are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sdvg.errors import ConfigError, ModelFileError
from sdvg.fixtures import loras as fl
from sdvg.fixtures import tiny
from sdvg.loaders import wan as wl
from sdvg.loaders.lora import LoraSpec, describe_lora, parse_lora_arg
from sdvg.loaders.model_info import describe_model_file

CFG = tiny.TINY_DRAFTER_CONFIG


@pytest.fixture(scope="module")
def dits(tmp_path_factory):
    return tiny.write_tiny_dits(tmp_path_factory.mktemp("lora-dits"))


@pytest.fixture(scope="module")
def factors():
    return fl.lora_factors(CFG, rank=4, alpha=2.0, seed=3)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory, factors):
    d = tmp_path_factory.mktemp("loras")
    out = {fmt: fl.write_lora(d / f"{fmt}.{'pt' if fmt == 'original-down' else 'safetensors'}", factors, fmt,
                              diffs=fl.diff_deltas(CFG, seed=5) if fmt == "diff" else None)
           for fmt in fl.FORMATS}
    out["bf16"] = fl.write_lora(d / "bf16.safetensors", factors, "kohya", dtype=torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def plain(dits):
    return wl.load_dit(dits["drafter"], dtype="fp32")


def hand_merged(path, terms: list[tuple[dict, float]], diffs: list[tuple[dict, float]] = (),
                dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The reference: W.float() + Σ strength·(alpha/rank)·(up @ down) (+ strength·diff), then the model's dtype."""
    sd, _ = wl.read_dit_state_dict(path)
    touched = {m + ".weight" for f, _ in terms for m in f} | {k for d, _ in diffs for k in d}
    out = {k: v.float().clone() if k in touched else v for k, v in sd.items()}
    for f, strength in terms:
        for module, (up, down, alpha) in f.items():
            out[module + ".weight"] += (up.float() @ down.float()) * (strength * alpha / down.shape[0])
    for d, strength in diffs:
        for key, delta in d.items():
            out[key] += delta.float() * strength
    return {k: v.to(dtype) if v.is_floating_point() and k in touched else v for k, v in out.items()}


def assert_weights_equal(model, reference: dict[str, torch.Tensor]) -> None:
    built = wl.build_dit_from_state_dict(reference, CFG, dtype=torch.float32)
    ref_sd, got = built.state_dict(), model.state_dict()
    assert set(ref_sd) == set(got)
    diff = [k for k in ref_sd if not torch.equal(ref_sd[k], got[k])]
    assert not diff, f"{len(diff)} tensors differ from the hand merge, e.g. {diff[:3]}"


@pytest.mark.parametrize("fmt", ["kohya", "diffusers", "original", "original-down"])
def test_every_layout_equals_the_hand_merge_bit_exactly(dits, lora_files, factors, plain, fmt):
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(lora_files[fmt], 0.8)])
    assert_weights_equal(model, hand_merged(dits["drafter"], [(factors, 0.8)]))
    # the merge really changed every targeted weight (and nothing else)
    changed = {k for k, v in plain.state_dict().items() if not torch.equal(v, model.state_dict()[k])}
    assert changed == {m + ".weight" for m in factors}


def test_full_diffs_and_two_loras_add_up(dits, lora_files, factors):
    diffs = fl.diff_deltas(CFG, seed=5)
    loras = [LoraSpec(lora_files["kohya"], 0.5), LoraSpec(lora_files["diffusers"], 1.0), LoraSpec(lora_files["diff"],
                                                                                                  2.0)]
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=loras)
    assert_weights_equal(model, hand_merged(dits["drafter"], [(factors, 0.5), (factors, 1.0)], [(diffs, 2.0)]))


def test_peft_metadata_alpha_pattern_and_rslora(dits, tmp_path, factors):
    import json

    sd, _ = fl.lora_state_dict(factors, "diffusers")
    meta = {"r": 4, "lora_alpha": 2.0, "alpha_pattern": {"ffn.net.2": 8.0}, "use_rslora": True}
    save_file(sd, str(tmp_path / "peft.safetensors"), metadata={"lora_adapter_metadata": json.dumps(meta)})
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(tmp_path / "peft.safetensors")])
    ref = hand_merged(dits["drafter"], [])
    for module, (up, down, _) in factors.items():  # PEFT: alpha (or its pattern's) / sqrt(r) with use_rslora
        alpha = 8.0 if module.endswith("ffn.net.2") else 2.0
        ref[module + ".weight"] = ref[module + ".weight"].float() + (up @ down) * (alpha * 2.0 / 4)
    assert_weights_equal(model, ref)


def test_strength_zero_is_no_lora_exactly(dits, lora_files, plain):
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(lora_files["kohya"], 0.0)])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())


def test_the_merge_is_the_lora_forward(dits, lora_files, factors, plain):
    """A merged linear computes x·Wᵀ + s·(alpha/r)·(x·downᵀ)·upᵀ, the LoRA's own definition (fp32 rounding)."""
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(lora_files["bf16"], 1.5)])
    up, down, alpha = factors["blocks.1.ffn.net.0.proj"]
    up, down = up.to(torch.bfloat16).float(), down.to(torch.bfloat16).float()  # the file stores bf16 factors
    x = torch.randn(5, down.shape[1], generator=torch.Generator().manual_seed(0))
    ref = plain.blocks[1].ffn.net[0].proj(x) + 1.5 * alpha / down.shape[0] * (x @ down.T) @ up.T
    torch.testing.assert_close(model.blocks[1].ffn.net[0].proj(x), ref, rtol=1e-5, atol=1e-6)


def test_bf16_target_merges_in_fp32_then_rounds_once(dits, tmp_path):
    cfg = tiny.TINY_TARGET_CONFIG
    f = fl.lora_factors(cfg, rank=2, seed=9)
    path = fl.write_lora(tmp_path / "t.safetensors", f, "original")
    model = wl.load_dit(dits["target"], dtype="bf16", loras=[LoraSpec(path)])
    sd, _ = wl.read_dit_state_dict(dits["target"])
    up, down, alpha = f["blocks.3.attn2.to_v"]
    ref = (sd["blocks.3.attn2.to_v.weight"].float() + (up @ down) * (alpha / 2)).to(torch.bfloat16)
    assert torch.equal(model.blocks[3].attn2.to_v.weight, ref)


def test_fp8_storage_merges_before_the_fp8_conversion_and_caches_stay_bf16(dits, lora_files, factors):
    model = wl.load_dit(dits["drafter"], dtype="fp8_e4m3fn", loras=[LoraSpec(lora_files["original"])])
    ref = hand_merged(dits["drafter"], [(factors, 1.0)])
    w = model.blocks[0].attn1.to_k.weight
    assert w.dtype == torch.float8_e4m3fn
    assert torch.equal(w, ref["blocks.0.attn1.to_k.weight"].to(torch.float8_e4m3fn))
    kv = model.new_kv_cache(batch=1, latent_hw=(4, 4), capacity_frames=3)
    assert kv.layer(0)[0].dtype == torch.bfloat16


def test_i2v_and_text_encoder_keys_are_skipped_with_a_warning_and_strict_refuses(dits, tmp_path, factors, caplog):
    sd, _ = fl.lora_state_dict(factors, "kohya")
    sd["lora_unet_blocks_0_cross_attn_k_img.lora_down.weight"] = torch.zeros(4, 64)  # an I2V LoRA key
    sd["lora_unet_blocks_0_cross_attn_k_img.lora_up.weight"] = torch.zeros(64, 4)
    sd["lora_te_text_model_encoder_layers_0.lora_up.weight"] = torch.zeros(64, 4)  # a text-encoder LoRA key
    save_file(sd, str(tmp_path / "i2v.safetensors"))
    with caplog.at_level("WARNING", logger="sdvg.loaders.lora"):
        model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(tmp_path / "i2v.safetensors", 0.8)])
    warning = caplog.text
    assert "2 image-to-video (I2V) layers" in warning and "k_img" in warning
    assert "1 text-encoder keys" in warning and "lora_te_text_model" in warning
    assert_weights_equal(model, hand_merged(dits["drafter"], [(factors, 0.8)]))  # the T2V part, exactly
    with pytest.raises(ModelFileError, match=r"I2V.*strict LoRA matching refuses them"):
        wl.load_dit(dits["drafter"], loras=[LoraSpec(tmp_path / "i2v.safetensors", strict=True)])
    only_i2v = {k: v for k, v in sd.items() if "k_img" in k}
    save_file(only_i2v, str(tmp_path / "only_i2v.safetensors"))
    with pytest.raises(ModelFileError, match="nothing else in it applies to a T2V DiT"):
        wl.load_dit(dits["drafter"], loras=[LoraSpec(tmp_path / "only_i2v.safetensors")])
    text = describe_model_file(tmp_path / "i2v.safetensors")
    assert "2 image-to-video (I2V) layers" in text and "1 text-encoder keys" in text and "merged at load" not in text


def test_keys_of_another_model_are_still_an_error_naming_them(dits, tmp_path, factors):
    sd, _ = fl.lora_state_dict(factors, "kohya")
    sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"] = torch.zeros(4, 64)  # a Flux/HunyuanVideo key
    save_file(sd, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelFileError, match=r"1 of \d+ LoRA keys match nothing.*double_blocks.*width 64"):
        wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(tmp_path / "other.safetensors")])


def test_a_lora_for_another_width_is_a_clear_error(dits, tmp_path):
    f = fl.lora_factors(tiny.TINY_TARGET_CONFIG, rank=2)
    path = fl.write_lora(tmp_path / "wide.safetensors", {k: v for k, v in f.items() if k.startswith("blocks.0.")},
                         "kohya")
    with pytest.raises(ConfigError, match=r"made for a DiT of width 512 .* has \[64, 64\]"):
        wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(path)])


def test_incomplete_pairs_and_unsupported_variants(dits, tmp_path, factors):
    sd, _ = fl.lora_state_dict(factors, "original")
    del sd["diffusion_model.blocks.0.self_attn.q.lora_B.weight"]
    save_file(sd, str(tmp_path / "half.safetensors"))
    with pytest.raises(ModelFileError, match=r"blocks\.0\.attn1\.to_q has no up"):
        wl.load_dit(dits["drafter"], loras=[LoraSpec(tmp_path / "half.safetensors")])
    save_file({"lora_unet_blocks_0_self_attn_q.hada_w1_a": torch.zeros(2, 2)}, str(tmp_path / "loha.safetensors"))
    with pytest.raises(ModelFileError, match="LoHa"):
        wl.load_dit(dits["drafter"], loras=[LoraSpec(tmp_path / "loha.safetensors")])


def test_lora_arguments(tmp_path, lora_files):
    assert parse_lora_arg(f"{lora_files['kohya']}:0.25") == LoraSpec(str(lora_files["kohya"]), 0.25)
    assert parse_lora_arg(str(lora_files["kohya"])).strength == 1.0
    with pytest.raises(ConfigError, match="finite"):
        parse_lora_arg(f"{lora_files['kohya']}:nan")
    with pytest.raises(ModelFileError, match="not found"):
        parse_lora_arg(str(tmp_path / "missing.safetensors:0.5"))
    with pytest.raises(ConfigError, match="finite"):
        LoraSpec("x", float("inf"))


@pytest.mark.parametrize("fmt,layout", [("kohya", "ComfyUI/kohya"), ("diffusers", "diffusers/PEFT"),
                                        ("original-down", "original Wan keys")])
def test_inspect_recognises_a_lora(lora_files, fmt, layout):
    text = describe_model_file(lora_files[fmt])
    assert f"LoRA in the {layout}" in text and "width 64" in text and "2 blocks" in text and "rank 4 (22×)" in text
    assert describe_lora(lora_files["diff"]).count("3 full diffs") == 1


def test_cli_merges_loras_and_offloads_and_refuses_a_wrong_lora_before_loading(tiny_dir, tmp_path, lora_files,
                                                                               capsys, monkeypatch):
    from sdvg.cli.commands import main
    from sdvg.loaders import bundle as pipeline
    from sdvg.loaders import text_encoder

    base = ["generate", "--prompt", "a cat", "--models", str(tiny_dir), "--device", "cpu", "--blocks", "2",
            "--width", "32", "--height", "32",
            "--tau=-inf", "--out", str(tmp_path / "v.mp4"), "--report", str(tmp_path / "r.json")]
    wide = fl.write_lora(tmp_path / "wide.safetensors", fl.lora_factors(tiny.TINY_TARGET_CONFIG, rank=2), "kohya")
    loaded = []
    monkeypatch.setattr(text_encoder, "load_text_encoder", lambda *a, **k: loaded.append(a) or 1 / 0)
    assert main([*base, "--drafter-lora", f"{wide}:0.5"]) == 2
    err = capsys.readouterr().err
    assert "made for a DiT of width 512 (custom), 4 blocks" in err and "the drafter" in err and not loaded  # refused before any load
    assert main([*base, "--target-offload-blocks", "two"]) == 2
    assert "resident blocks" in capsys.readouterr().err
    monkeypatch.undo()
    seen = {}
    real = pipeline.load_models

    def spy(*a, **k):
        models = real(*a, **k)
        seen.update(models=models, kw=k)
        return models

    monkeypatch.setattr(pipeline, "load_models", spy)
    code = main([*base, "--drafter-lora", f"{lora_files['kohya']}:0.8", "--drafter-lora", str(lora_files["diff"]),
                 "--target-offload-blocks", "1", "--text-encoder-device", "cpu"])
    assert code == 0, capsys.readouterr().err
    models = seen["models"]
    assert models.target.block_offloader.resident == 1 and models.drafter.block_offloader is None
    assert seen["kw"]["text_device"] == "cpu" and models.text_encoder.device.type == "cpu"
    assert [(Path(lo.path).name, lo.strength) for lo in seen["kw"]["loras"]["drafter"]] == [("kohya.safetensors", 0.8),
                                                                                     ("diff.safetensors", 1.0)]
    factors = fl.lora_factors(CFG, rank=4, alpha=2.0, seed=3)
    ref = hand_merged(tiny_dir / "diffusion_models" / "sdvg_tiny_drafter.pt", [(factors, 0.8)],
                      [(fl.diff_deltas(CFG, seed=5), 1.0)])
    assert_weights_equal(models.drafter, ref)


def test_every_missing_model_file_is_named_at_once(tmp_path, capsys):
    from sdvg.cli.commands import main

    missing = {r: tmp_path / f"{r}.safetensors" for r in ("target", "drafter", "vae")}
    code = main(["generate", "--prompt", "x", "--out", str(tmp_path / "v.mp4"), "--target", str(missing["target"]),
                 "--drafter", str(missing["drafter"]), "--vae", str(missing["vae"]), "--tau=-inf"])
    err = capsys.readouterr().err
    assert code == 2 and "model files are missing or unusable" in err
    # the roles no file was given for come from the toy world's models (and that is said)
    assert all(str(p) in err for p in missing.values()) and "for every role but drafter, target, vae" in err


@pytest.mark.parametrize("fmt", fl.MORE_FORMATS)
def test_the_other_tools_layouts_equal_the_hand_merge_bit_exactly(dits, tmp_path, factors, fmt, caplog):
    """LyCORIS naming (SimpleTuner / ai-toolkit), VideoX-Fun's lora_unet__, DiffSynth/UniAnimate's pipe.dit. (no
    alpha: alpha = rank) and a diffusers file with text-encoder keys (skipped with a warning)."""
    f = {m: (up, down, float(down.shape[0])) for m, (up, down, _a) in factors.items()} if fmt == "diffsynth" \
        else factors
    path = fl.write_lora(tmp_path / f"{fmt}.safetensors", f, fmt)
    with caplog.at_level("WARNING", logger="sdvg.loaders.lora"):
        model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(path, 0.7)])
    assert_weights_equal(model, hand_merged(dits["drafter"], [(f, 0.7)]))
    assert ("text-encoder keys" in caplog.text) == (fmt == "diffusers-te")
    layout = {"lycoris": "LyCORIS naming", "videox-fun": "VideoX-Fun", "diffsynth": "DiffSynth/UniAnimate",
              "diffusers-te": "diffusers/PEFT"}[fmt]
    text = describe_model_file(path)
    assert layout in text and "width 64" in text and "2 blocks" in text and "rank 4 (22×)" in text
    assert ("2 text-encoder keys" in text) == (fmt == "diffusers-te")


def test_wanvideowrapper_diff_m_is_the_modulation_delta(dits, tmp_path):
    gen = torch.Generator().manual_seed(8)
    diffs = {"blocks.0.scale_shift_table": torch.randn(1, 6, 64, generator=gen) * 0.01,
             "scale_shift_table": torch.randn(1, 2, 64, generator=gen) * 0.01}
    path = fl.write_lora(tmp_path / "diff_m.safetensors", {}, "diff_m", diffs=diffs)
    from safetensors.torch import load_file

    assert set(load_file(str(path))) == {"diffusion_model.blocks.0.diff_m", "diffusion_model.head.diff_m"}
    model = wl.load_dit(dits["drafter"], dtype="fp32", loras=[LoraSpec(path, 0.5)])
    assert_weights_equal(model, hand_merged(dits["drafter"], [], [(diffs, 0.5)]))


def test_cli_lora_strict_refuses_an_i2v_lora_before_loading(tiny_dir, tmp_path, factors, capsys):
    from sdvg.cli.commands import main

    sd, _ = fl.lora_state_dict(factors, "original")
    sd["diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight"] = torch.zeros(4, 64)
    sd["diffusion_model.blocks.0.cross_attn.k_img.lora_B.weight"] = torch.zeros(64, 4)
    save_file(sd, str(tmp_path / "i2v.safetensors"))
    code = main(["generate", "--prompt", "x", "--models", str(tiny_dir), "--device", "cpu", "--blocks", "1",
                 "--drafter-lora", str(tmp_path / "i2v.safetensors"), "--lora-strict", "--out", str(tmp_path / "v.mp4")])
    assert code == 2 and "strict LoRA matching refuses them" in capsys.readouterr().err
    assert not (tmp_path / "v.mp4").exists()
