"""Scaled-fp8 DiT files: a float8 weight with a float32 scale beside it, in ComfyUI's two layouts.

* ``scale_weight`` (Comfy-Org's ``*_fp8_scaled`` repackages): ``X.weight`` float8_e4m3fn, ``X.scale_weight`` one
  float32 (per tensor), a ``scaled_fp8`` marker tensor, sometimes ``X.scale_input``;
* ``weight_scale`` (ComfyUI's quantization metadata): ``X.weight`` float8, ``X.weight_scale`` float32, the layer's
  format in a ``X.comfy_quant`` uint8 JSON tensor and/or the file's ``_quantization_metadata`` JSON
  (``{"layers": {"X": {"format": "float8_e4m3fn"}}}``), sometimes ``X.input_scale``.

The true weight is ``weight.float() * scale``. The loader hands each scaled weight to the builder as a
:class:`~sdvg.models.quant.ScaledFP8`, so the layer keeps fp8 + scale on the device (``QuantLinear``); input scales
are not used (the compute is bf16/fp32, not fp8 matmuls). Formats other than float8 (int8, nvfp4, mxfp8) are refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from ..errors import ModelFileError
from ..models.quant import ScaledFP8

SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
SCALE_MARKERS = (".scale_input", ".input_scale", ".comfy_quant")
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_marker(key: str) -> bool:
    """A file's ``scaled_fp8`` marker, an input scale or a ``comfy_quant`` format entry: not a weight."""
    return key == "scaled_fp8" or key.endswith(SCALE_MARKERS)


def scaled_weight_key(key: str) -> str | None:
    """The weight a scale entry belongs to (``X.scale_weight`` / ``X.weight_scale`` → ``X.weight``); None for
    any other key."""
    return key[: key.rfind(".")] + ".weight" if key.endswith(SCALE_SUFFIXES) else None


def split_scales(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights in either layout → (the weights without scale and marker entries, weight key → its scale)."""
    kept, scales = {}, {}
    for k, v in weights.items():
        weight = scaled_weight_key(k)
        if weight is not None:
            scales[weight] = v
        elif not is_marker(k):
            kept[k] = v
    return kept, scales


def stored_nbytes(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype | None]) -> dict[str, int]:
    """Bytes of each tensor as stored (from a header's shapes and dtypes)."""
    out = {}
    for k, shape in shapes.items():
        dt = dtypes.get(k)
        out[k] = math.prod(shape) * (torch.empty((), dtype=dt).element_size() if dt is not None else 0)
    return out


def _formats(src) -> dict[str, str]:
    """Layer name (as in the file) → its declared quantization format, from ``_quantization_metadata``."""
    raw = src.metadata.get("_quantization_metadata")
    if not raw:
        return {}
    try:
        layers = json.loads(raw).get("layers") or {}
        return {str(k): str(v.get("format")) for k, v in layers.items() if isinstance(v, dict)}
    except (ValueError, AttributeError) as exc:
        raise ModelFileError(f"{src.path}: its _quantization_metadata is not valid JSON ({exc}).") from exc


def _marker_formats(src, raws: list[str]) -> dict[str, str]:
    """Layer → format from the ``X.comfy_quant`` tensors (tiny uint8 JSON; read here)."""
    if not raws:
        return {}
    read = src.tensors_by_name({r: r for r in raws}, torch.device("cpu"))
    out = {}
    for r in raws:
        try:
            out[r[: -len(".comfy_quant")]] = str(json.loads(bytes(read[r].to(torch.uint8).tolist()))["format"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{src.path}: {r} is not a valid comfy_quant JSON tensor ({exc}).") from exc
    return out


def find_scales(src, raw_to_key: dict[str, str]) -> dict[str, str]:
    """Record the scaled-fp8 weights of ``src`` (``src.scales``, ``src.quant``) and return ``raw_to_key`` without the
    scale and marker entries. A scaled layer whose format is no float8, or whose weight is no float8, is refused."""
    formats = _formats(src)
    formats.update(_marker_formats(src, [r for r in raw_to_key if r.endswith(".comfy_quant")]))
    bad = {layer: f for layer, f in formats.items() if f not in FP8_FORMATS}
    if bad:
        layer, fmt = next(iter(bad.items()))
        raise ModelFileError(
            f"{src.path}: {len(bad)} layers are quantized as {fmt!r} (e.g. {layer}); SDVG loads float8 scaled weights "
            f"({', '.join(FP8_FORMATS)}), GGUF files and bf16/fp16/fp8 files. Use one of those for this model."
        )
    kept = {}
    for raw, key in raw_to_key.items():
        if is_marker(raw):
            continue
        weight = scaled_weight_key(raw)
        if weight is not None:
            if weight not in raw_to_key:
                raise ModelFileError(f"{src.path}: a scale {raw} without its weight {weight}; the file is incomplete.")
            if src.dtypes.get(weight) not in FP8_DTYPES:
                raise ModelFileError(f"{src.path}: {weight} has a scale but is stored as {src.dtypes.get(weight)}, "
                                     "not float8; SDVG loads float8 scaled weights only.")
            src.scales[weight] = raw
            src.quant[weight] = "fp8_scaled"
            continue
        kept[raw] = key
    return kept


class _WithScales(Mapping):
    def __init__(self, base: Mapping, scale_of: dict[str, str]) -> None:
        self._base, self._scale_of = base, scale_of
        self._names = [n for n in base if not n.endswith("\0scale")]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def __getitem__(self, name: str):
        if name in self._scale_of:
            return ScaledFP8(self._base[name], self._base[self._scale_of[name]].to(torch.float32))
        return self._base[name]


def with_scales(src, names: dict[str, str], device: torch.device) -> Mapping:
    """``src.tensors_by_name(names)`` where every scaled weight reads as a :class:`ScaledFP8` (weight + scale)."""
    scale_of, all_names = {}, dict(names)
    for name, raw in names.items():
        if raw in src.scales:
            scale_of[name] = name + "\0scale"
            all_names[name + "\0scale"] = src.scales[raw]
    return _WithScales(src.tensors_by_name(all_names, device), scale_of)
