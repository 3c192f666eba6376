"""Weights that stay quantized on the device and are dequantized layer by layer in the forward.

Two stored forms, one module (:class:`QuantLinear`, a drop-in for the DiT's ``nn.Linear`` layers):

* **GGUF blocks** (llama.cpp's ``ggml`` types, as city96's GGUF DiTs and ComfyUI-GGUF hold them): the weight is a
  ``uint8 [out, row_bytes]`` tensor of quantization blocks. The kernels below dequantize Q8_0, Q4_0, Q4_K, Q5_K and
  Q6_K in torch on the weight's own device, in float32, with the same arithmetic as gguf's reference ``dequantize``
  (so the values are bit-identical to it; ``tests/test_gguf.py`` checks every type on random blocks). Other ggml
  types have no kernel here: a loader dequantizes those once, at load.
* **scaled fp8** (ComfyUI's ``scale_weight`` / ``weight_scale`` layouts): a float8 weight and its float32 scale
  (one per tensor, or one per output row); the weight is ``weight.float() * scale``.

A :class:`QuantLinear` forward computes ``F.linear(x, dequantized(x.dtype), bias)``: the full-precision weight lives
for one layer call only, so the device holds the quantized bytes plus one layer's dequantized weight. Block offload
streams the quantized bytes (they are ordinary parameters). :class:`QuantTensor` is what a loader hands the builder
for a GGUF weight. Nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

QK_K = 256  # elements per K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at bytes ``start:start+2`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """``qs [n, groups*32]`` bytes → ``[n, groups*2, 32]`` 4-bit values: per 32-byte group its low nibbles, then its
    high nibbles."""
    return _bit_fields(qs.reshape(qs.shape[0], groups, 32), 4, 2).reshape(qs.shape[0], groups * 2, 32)


def _bit_fields(q: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """``q [..., k, m]`` bytes → ``[..., k, count, m]``: the ``count`` fields of ``width`` bits of each byte, lowest
    first (shifts by Python ints: no constant tensor is made or copied to the device per call)."""
    mask = (1 << width) - 1
    return torch.stack([(q >> (i * width)) & mask for i in range(count)], dim=-2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K super-block → its eight 6-bit scales and eight 6-bit mins (float32)."""
    b = packed.reshape(-1, 3, 4)
    lo, mid, hi = b[:, 0], b[:, 1], b[:, 2]
    scales = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # 32 values: d (f16), 32 × int8
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # 32 values: d (f16), 16 bytes of nibbles (low half, high half)
    qs = blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int8) - 8
    return _f16(blocks, 0) * q.to(torch.float32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # 256 values: d, dmin (f16), 12 scale bytes, 128 nibble bytes
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 4).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # 256 values: d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibbles
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn).reshape(n, 8, 1)
    low = _nibbles(blocks[:, 48:], 4)
    high = _bit_fields(blocks[:, 16:48].reshape(n, 1, 32), 1, 8).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # 256 values: 128 low-nibble bytes, 64 high-2-bit bytes, 16 int8 scales, d
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(blocks, 208) * scales).reshape(n, 16, 1)
    ql = _bit_fields(blocks[:, :128].reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    qh = _bit_fields(blocks[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: its name, values and bytes per block, and the torch kernel (None: no kernel here)."""

    name: str
    block_values: int
    block_bytes: int
    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def row_bytes(self, row_values: int) -> int:
        return row_values // self.block_values * self.block_bytes


# ggml's type numbers (ggml.h / gguf.GGMLQuantizationType)
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4), 1: GGMLType("F16", 1, 2), 30: GGMLType("BF16", 1, 2),
    2: GGMLType("Q4_0", 32, 18, _q4_0), 3: GGMLType("Q4_1", 32, 20), 6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24), 8: GGMLType("Q8_0", 32, 34, _q8_0), 10: GGMLType("Q2_K", QK_K, 84),
    11: GGMLType("Q3_K", QK_K, 110), 12: GGMLType("Q4_K", QK_K, 144, _q4_k), 13: GGMLType("Q5_K", QK_K, 176, _q5_k),
    14: GGMLType("Q6_K", QK_K, 210, _q6_k),
}
PLAIN_GGML = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
FP8_SCALED = -1  # QuantLinear.qtype of a scaled-fp8 weight


def ggml_type(qtype: int) -> GGMLType:
    return GGML_TYPES.get(int(qtype), GGMLType(f"ggml type {int(qtype)}", 1, 0))


def has_kernel(qtype: int) -> bool:
    return ggml_type(qtype).kernel is not None


def dequantize_blocks(data: torch.Tensor, qtype: int, shape: tuple[int, ...],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF bytes ``data`` (``uint8``, any shape holding whole blocks) of type ``qtype`` → a ``shape`` tensor of
    ``dtype`` on ``data``'s device (computed in float32)."""
    kind = ggml_type(qtype)
    if kind.kernel is None:
        raise NotImplementedError(f"no torch kernel for GGUF {kind.name}")
    blocks = data.reshape(-1, kind.block_bytes)
    return kind.kernel(blocks).reshape(shape).to(dtype)


@dataclass
class QuantTensor:
    """A GGUF-quantized tensor as a loader hands it over: its bytes, ggml type and logical shape."""

    data: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: int
    shape: tuple[int, ...]

    @property
    def type_name(self) -> str:
        return ggml_type(self.qtype).name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.data, self.qtype, self.shape, dtype)

    def to(self, device: str | torch.device) -> QuantTensor:
        return QuantTensor(self.data.to(device), self.qtype, self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass
class ScaledFP8:
    """A scaled-fp8 weight as a loader hands it over: the float8 tensor and its float32 scale."""

    weight: torch.Tensor
    scale: torch.Tensor

    qtype = FP8_SCALED
    type_name = "fp8_scaled"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def data(self) -> torch.Tensor:
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return scaled_fp8_weight(self.weight, self.scale, dtype)

    def to(self, device: str | torch.device) -> ScaledFP8:
        return ScaledFP8(self.weight.to(device), self.scale.to(device))

    @property
    def device(self) -> torch.device:
        return self.weight.device


def is_stored_quant(value) -> bool:
    """A weight handed over in stored form (:class:`QuantTensor` or :class:`ScaledFP8`), not a plain tensor."""
    return isinstance(value, (QuantTensor, ScaledFP8))


def scaled_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight.float() * scale`` (one scale, or one per output row), as ``dtype``: one float32 copy, scaled in
    place (this runs in every call of a scaled-fp8 layer)."""
    s = scale.to(weight.device, torch.float32)
    if s.numel() > 1:
        s = s.reshape(-1, *([1] * (weight.dim() - 1)))
    else:
        s = s.reshape(())
    return weight.to(torch.float32, copy=True).mul_(s).to(dtype)  # copy: never scale a float32 weight in place


class QuantLinear(nn.Module):
    """``nn.Linear`` with its weight kept in stored form (GGUF bytes or scaled fp8), dequantized per call.

    ``weight`` is the stored tensor (``uint8`` blocks or float8), ``scale`` the fp8 scale (None for GGUF), ``qtype``
    the ggml type (``FP8_SCALED`` for fp8). Built on the meta device and filled by ``load_state_dict(assign=True)``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, qtype: int,
                 weight_shape: tuple[int, ...], weight_dtype: torch.dtype, scale_shape: tuple[int, ...] | None = None,
                 device: str | torch.device = "meta") -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = int(in_features), int(out_features), int(qtype)
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=weight_dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self.scale = (nn.Parameter(torch.empty(scale_shape, device=device), requires_grad=False)
                      if scale_shape is not None else None)

    @property
    def type_name(self) -> str:
        return "fp8_scaled" if self.qtype == FP8_SCALED else ggml_type(self.qtype).name

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if self.qtype == FP8_SCALED:
            return scaled_fp8_weight(self.weight, self.scale, dtype)
        return dequantize_blocks(self.weight, self.qtype, shape, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name}"


def quant_linear_like(linear: nn.Linear, weight: torch.Tensor, qtype: int,
                      scale: torch.Tensor | None = None) -> QuantLinear:
    """A meta :class:`QuantLinear` in place of ``linear`` for a stored ``weight`` (and fp8 ``scale``)."""
    return QuantLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, qtype=qtype,
                       weight_shape=tuple(weight.shape), weight_dtype=weight.dtype,
                       scale_shape=tuple(scale.shape) if scale is not None else None)


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def quant_summary(model: nn.Module) -> dict[str, int]:
    """``{type name: count}`` of the model's quantized layers."""
    out: dict[str, int] = {}
    for m in quantized_layers(model).values():
        out[m.type_name] = out.get(m.type_name, 0) + 1
    return out


