"""Scaled-fp8 DiTs in both ComfyUI layouts (``scale_weight``; ``weight_scale`` + quantization metadata): loaded as
fp8 + scale, equal to a hand dequantization, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sdvg.errors import ModelFileError
from sdvg.fixtures.quant_files import write_fp8_scaled_dit
from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict
from sdvg.loaders.dit_build import build_dit_from_state_dict
from sdvg.loaders.model_info import describe_model_file
from sdvg.loaders.safetensors_io import LazyTensors, read_safetensors_header
from sdvg.loaders.wan import inspect_dit_checkpoint, load_dit
from sdvg.loaders.wan_keys import original_to_diffusers
from sdvg.models.quant import QuantLinear, quant_summary

HEADS = TINY_TARGET_CONFIG["num_attention_heads"]
PREFIX = "model.diffusion_model."


def _hand_dequantized(path) -> dict[str, torch.Tensor]:
    """weight.float() * scale for every scaled weight, the rest as stored; markers dropped."""
    lazy = LazyTensors(read_safetensors_header(path))
    keys = list(read_safetensors_header(path).shapes)
    out = {}
    for k in keys:
        stem = k.removeprefix(PREFIX)
        if stem == "scaled_fp8" or stem.endswith((".scale_weight", ".weight_scale", ".comfy_quant")):
            continue
        t = lazy[k]
        for scale_key in (k[: -len("weight")] + "scale_weight", k + "_scale"):
            if scale_key in keys:
                t = t.float() * lazy[scale_key].float().reshape(())
        out[stem] = t.float()
    return out


def _calls(model):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16, 3, 4, 6, generator=gen)
    cross = model.prepare_cross_attention(torch.randn(1, 7, model.config.text_dim, generator=gen))
    kv = model.new_kv_cache(batch=1, latent_hw=(4, 6), capacity_frames=6)
    t = torch.full((1, 3), 500.0)
    return [*cross.k, model.forward_block(x, t, kv, cross), model.forward_block(x, t, kv, cross, frame_offset=3)]


@pytest.mark.parametrize("layout", ["scale_weight", "weight_scale"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_scaled_fp8_loads_as_fp8_plus_scale_and_equals_a_hand_dequantization(tmp_path, layout, dtype):
    path = write_fp8_scaled_dit(tmp_path / f"tiny_fp8_{layout}.safetensors",
                                random_original_state_dict(TINY_TARGET_CONFIG, seed=11), layout=layout,
                                num_heads=HEADS)
    info = inspect_dit_checkpoint(path)
    assert info.scaled_fp8 and info.quantized and info.quant["fp8_scaled"] == 4 * 10 + 6  # q k v o twice, ffn ×2 per block; embeddings, head
    model = load_dit(path, dtype=dtype, offload_blocks=2)
    q = model.blocks[3].attn2.to_v
    assert isinstance(q, QuantLinear) and q.weight.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert quant_summary(model) == {"fp8_scaled": info.quant["fp8_scaled"] - 2}  # time embedding: dequantized, fp32
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    ref = build_dit_from_state_dict(original_to_diffusers(_hand_dequantized(path)), TINY_TARGET_CONFIG, dtype=want)
    for a, b in zip(_calls(model), _calls(ref), strict=True):
        assert torch.equal(a, b)
    assert "fp8_scaled" in describe_model_file(path)


def test_a_scaled_format_that_is_not_float8_is_refused(tmp_path):
    path = tmp_path / "int8.safetensors"
    sd = random_original_state_dict(TINY_TARGET_CONFIG, seed=1)
    tensors = {PREFIX + k: v.to(torch.bfloat16) for k, v in sd.items()}
    stem = PREFIX + "blocks.0.self_attn.q"
    tensors[stem + ".weight"] = torch.zeros(512, 512, dtype=torch.int8)
    tensors[stem + ".weight_scale"] = torch.ones(512)
    tensors[stem + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()),
                                                  dtype=torch.uint8)
    save_file(tensors, str(path), metadata={"sdvg.num_heads": str(HEADS)})
    with pytest.raises(ModelFileError, match="int8_tensorwise"):
        inspect_dit_checkpoint(path)
