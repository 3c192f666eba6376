"""What *SDVG DiT from MODEL* gets from a quantized core MODEL, without ComfyUI: the weights as ComfyUI-GGUF's loader
holds them (``GGMLTensor``: a torch.Tensor of the GGUF bytes with ``tensor_type`` / ``tensor_shape``) and as a
scaled-fp8 MODEL holds them (fp8 weights + ``scale_weight``), through the engine's mapping into ``dit_from_weights``:
the same model, bit for bit, as SDVG's own loader makes from the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdvg.fixtures.quant_files import write_fp8_scaled_dit, write_gguf_dit
from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict
from sdvg.loaders.from_weights import core_nbytes, core_weight, dit_from_weights
from sdvg.loaders.scaled_fp8 import split_scales
from sdvg.loaders.wan import load_dit
from sdvg.models.quant import quant_summary

gguf = pytest.importorskip("gguf")
HEADS = TINY_TARGET_CONFIG["num_attention_heads"]


class GGMLLike(torch.Tensor):
    """The attributes and the ``shape`` override ComfyUI-GGUF's ``GGMLTensor`` has (its bytes, the logical shape)."""

    @staticmethod
    def __new__(cls, data, *, tensor_type, tensor_shape):
        out = torch.Tensor._make_subclass(cls, data)
        out.tensor_type, out.tensor_shape = tensor_type, tensor_shape
        return out

    @property
    def shape(self):
        return self.tensor_shape


def _as_comfyui_gguf_holds_it(path) -> dict[str, torch.Tensor]:
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        field = reader.get_field(f"comfy.gguf.orig_shape.{t.name}")
        shape = torch.Size(field.contents() if field is not None else reversed([int(v) for v in t.shape]))
        data = torch.from_numpy(np.array(t.data))
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = data.view(*shape)
        out[t.name] = GGMLLike(data, tensor_type=t.tensor_type, tensor_shape=shape)
    return out


def _calls(model):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 3, 4, 6, generator=gen)
    cross = model.prepare_cross_attention(torch.randn(1, 7, model.config.text_dim, generator=gen))
    return [*cross.k, model.forward_block(x, torch.full((1, 3), 600.0), None, cross)]


def _from_core(weights, **kw):
    weights, scales = split_scales(weights)
    return dit_from_weights(lambda k: core_weight(weights[k], scales.get(k)), {k: tuple(v.shape) for k, v in
                            weights.items()}, heads=HEADS, stored_dtype=torch.float32, dtype="fp32",
                            quantized_bytes=sum(core_nbytes(v) for v in (*weights.values(), *scales.values())), **kw)


def test_a_comfyui_gguf_model_maps_to_the_same_quantized_dit_as_the_file(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf_dit(path, random_original_state_dict(TINY_TARGET_CONFIG, seed=9), qtype="Q4_K",
                   types={"blocks.0.ffn.0.weight": "Q6_K"}, num_heads=HEADS)
    held = _as_comfyui_gguf_holds_it(path)
    assert tuple(held["blocks.0.self_attn.q.weight"].shape) == (512, 512)  # logical, as the host reports it
    core = _from_core(held)
    assert quant_summary(core) == quant_summary(load_dit(path, dtype="fp32"))
    for a, b in zip(_calls(core), _calls(load_dit(path, dtype="fp32")), strict=True):
        assert torch.equal(a, b)


def test_a_scaled_fp8_core_model_keeps_fp8_and_its_scales(tmp_path):
    path = write_fp8_scaled_dit(tmp_path / "t_fp8_scaled.safetensors",
                                random_original_state_dict(TINY_TARGET_CONFIG, seed=4), num_heads=HEADS, prefix="")
    held = {k: v for k, v in load_file(str(path)).items()}  # what model_state_dict gives for such a MODEL
    core = _from_core(held)
    assert quant_summary(core)["fp8_scaled"] > 0
    for a, b in zip(_calls(core), _calls(load_dit(path, dtype="fp32")), strict=True):
        assert torch.equal(a, b)
