"""Loading the model bundle: paths checked first, the text encoder's width and the DiT pair checked right after
loading, with messages that name both files and the fix."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from sdvg.errors import ConfigError, ModelFileError
from sdvg.fixtures import tiny
from sdvg.loaders.bundle import check_text_width, load_models
from sdvg.loaders.wan_keys import META_NUM_HEADS, make_config


def _write_dit(path, *, text_dim: int = tiny.TINY_TEXT_DIM, patch=(1, 2, 2)):
    config = make_config(2, 16, 16, 16, text_dim, 64, 64, 1, patch)
    sd = tiny.random_original_state_dict(config, seed=5)
    save_file({"model." + k: v for k, v in sd.items()}, str(path), metadata={META_NUM_HEADS: "2"})
    return path


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_text_encoder_narrower_than_the_dit_is_refused_naming_both(tiny_dir, tmp_path, role):
    wide = _write_dit(tmp_path / "wide_dit.safetensors", text_dim=96)
    with pytest.raises(ConfigError) as err:
        load_models(tiny_dir, **{role: wide}, need=(role, "text_encoder", "vae"), dit_device="cpu",
                    aux_device="cpu", dtype="fp32")
    msg = str(err.value)
    te_file = tiny_dir / "text_encoders" / "sdvg_tiny_umt5.safetensors"
    assert f"The text encoder {te_file} gives {tiny.TINY_TEXT_DIM}-wide embeddings, but the {role} DiT {wide} " \
           "takes text_dim 96: use the text encoder this DiT was made with (96 wide)." in msg, msg


def test_real_size_mismatch_names_the_umt5_xxl_encoder(tmp_path):
    class Encoder:
        text_dim = 2048

    class DiT:
        config = {"text_dim": 4096}

    with pytest.raises(ConfigError, match=r"gives 2048-wide embeddings, but the target DiT \S*krea.safetensors takes "
                                          r"text_dim 4096: use the UMT5-XXL encoder that matches these DiTs "
                                          r"\(4096 wide\), e.g. umt5_xxl_fp8_e4m3fn_scaled.safetensors"):
        check_text_width(Encoder(), tmp_path / "t5_base.safetensors", DiT(), "target", tmp_path / "krea.safetensors")
    Encoder.text_dim = 4096
    check_text_width(Encoder(), tmp_path / "t5.safetensors", DiT(), "target", tmp_path / "krea.safetensors")
    check_text_width(None, None, DiT(), "target", tmp_path / "krea.safetensors")


def test_drafter_that_does_not_match_the_target_is_refused_after_loading(tiny_dir, tmp_path):
    odd = _write_dit(tmp_path / "odd_text_drafter.safetensors", text_dim=96)
    with pytest.raises(ConfigError) as err:  # no text encoder asked for: the pair rule itself speaks
        load_models(tiny_dir, drafter=odd, need=("target", "drafter", "vae"), dit_device="cpu",
                    aux_device="cpu", dtype="fp32")
    msg = str(err.value)
    assert f"text_dim is 96 for the drafter {odd} and {tiny.TINY_TEXT_DIM} for the target" in msg, msg
    assert "pick a drafter made for this target" in msg


def test_missing_and_broken_model_paths_and_bad_devices(tiny_dir, tmp_path):
    link = tmp_path / "krea.safetensors"
    link.symlink_to(tmp_path / "external" / "krea.safetensors")
    with pytest.raises(ModelFileError, match="krea.safetensors is a broken symbolic link: it points to ") as err:
        load_models(tiny_dir, target=link, need=("target", "vae"))
    assert "does not exist" not in str(err.value)
    with pytest.raises(ModelFileError, match=r"The target file .*nope.pt does not exist. Fix the path, or put the "
                                             r"file in models/diffusion_models/"):
        load_models(tiny_dir, target=tmp_path / "nope.pt", need=("target", "vae"))
    for device in ("meta", "xla"):
        with pytest.raises(ConfigError, match=f"The device '{device}' for the DiTs"):
            load_models(tiny_dir, need=("target", "vae"), dit_device=device)


def test_the_sampler_checks_the_pair_with_the_same_rule(tiny_models, tmp_path):
    """Models built elsewhere (a ComfyUI MODEL, the API) meet the same drafter/target check before a run starts: they
    share the latent channels and the text width; the patching is each model's own (its own tokens, its own cache),
    so a patch-1×1 drafter drafts for a patch-2×2 target."""
    from dataclasses import replace

    import torch

    from sdvg.loaders import load_dit
    from sdvg.models.dit import check_dit_pair
    from sdvg.sampling import RouterConfig, SamplerConfig, SpeculativeSampler

    wide = load_dit(_write_dit(tmp_path / "wide.safetensors", text_dim=96), dtype="fp32", device="cpu")
    with pytest.raises(ConfigError, match=r"text_dim is 96 for the drafter and 64 for the target\."):
        check_dit_pair(tiny_models.target.config, wide.config)
    with pytest.raises(ConfigError, match="the drafter reads 96-wide prompt embeddings"):  # the sampler refuses it
        SpeculativeSampler(replace(tiny_models, drafter=wide), RouterConfig(), SamplerConfig(num_blocks=2, width=32,
                                                                                             height=32))
    odd = load_dit(_write_dit(tmp_path / "odd.safetensors", patch=(1, 1, 1)), dtype="fp32", device="cpu")
    check_dit_pair(tiny_models.target.config, odd.config)
    cfg = SamplerConfig(num_blocks=2, width=32, height=32)
    res = SpeculativeSampler(replace(tiny_models, drafter=odd), RouterConfig(mode="draft-only"), cfg).run("a cat")
    target = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), cfg).run("a cat")
    assert res.frames.shape == target.frames.shape and torch.isfinite(res.frames).all()
    assert [b.produced_by for b in res.blocks] == ["drafter", "drafter"]
    assert not torch.equal(res.frames, target.frames)  # the patch-1×1 drafter's own video
