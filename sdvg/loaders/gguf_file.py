"""GGUF DiT files (city96's layout, as ComfyUI-GGUF loads them) read with the ``gguf`` package, one tensor at a time.

A GGUF DiT holds the original Wan keys (``blocks.0.self_attn.q.weight`` …, sometimes behind
``model.diffusion_model.``), ``general.architecture = "wan"``, quantized 2-D weights (Q8_0, Q6_K, Q5_K, Q4_K, …) and
unquantized F32/F16/BF16 tensors (norms, modulation, biases, the 5-D patch embedding, whose shape is kept in the
``comfy.gguf.orig_shape.<name>`` metadata). Tensor shapes in GGUF are reversed (``ne`` order); the logical shape is
the metadata's, else the reversed one. The file is memory-mapped by gguf's reader for its header only; each tensor is
read with plain reads (never through the map) when it is asked for: plain tensors as torch tensors, quantized ones as :class:`~sdvg.models.quant.QuantTensor` (their bytes,
``uint8 [rows, row_bytes]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ModelFileError
from ..models.quant import PLAIN_GGML, QuantTensor, ggml_type
from .safetensors_io import read_span
from .wan_keys import META_NUM_HEADS

ORIG_SHAPE = "comfy.gguf.orig_shape."
ARCHITECTURES = ("wan", None)  # city96's Wan files say "wan"; sd.cpp-style files say nothing


@dataclass
class GGUFContents:
    """What a GGUF file holds: logical shapes, ggml type per tensor, the string metadata, and a reader."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, int]  # tensor name → ggml type number
    metadata: dict[str, Any]
    _tensors: dict[str, Any]

    def type_name(self, name: str) -> str:
        return ggml_type(self.types[name]).name

    def stored_bytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def read(self, name: str) -> torch.Tensor | QuantTensor:
        """One tensor copied out of the map: a torch tensor (F32/F16/BF16) or a :class:`QuantTensor`."""
        t, shape, qtype = self._tensors[name], self.shapes[name], self.types[name]
        data = read_span(self.path, int(t.data_offset), int(t.n_bytes))  # plain reads: the map is never touched
        if len(data) != int(t.n_bytes):
            raise ModelFileError(f"{self.path}: tensor {name} is cut short ({len(data)} of {int(t.n_bytes)} bytes); "
                                 "the download is incomplete. Fetch the file again.")
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        if qtype in PLAIN_GGML:
            return raw.view(PLAIN_GGML[qtype]).reshape(shape)
        kind = ggml_type(qtype)
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if kind.kernel is None:  # no torch kernel (Q2_K, Q3_K, Q4_1, Q5_0, …): gguf's numpy dequantize, once, here
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            values = dequantize(raw.numpy().reshape(rows, -1), GGMLQuantizationType(qtype))
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
        return QuantTensor(raw.reshape(rows, kind.row_bytes(shape[-1])), qtype, shape)


def _field(reader, name: str):
    field = reader.get_field(name)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - older gguf versions: parts/data
        return None


def _orig_shape(reader, name: str) -> tuple[int, ...] | None:
    value = _field(reader, ORIG_SHAPE + name)
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else None


def open_gguf(path: str | Path) -> GGUFContents:
    """Read a GGUF file's header (memory-mapped; no tensor is copied). Anything but a Wan DiT GGUF is an error."""
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError(f"{path}: reading GGUF files needs the 'gguf' package (llama.cpp's reader, pure Python), "
                          "which is not installed in this Python: pip install gguf (it is in the pack's "
                          "requirements.txt).") from exc

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc}). The download may be incomplete; fetch it "
                             "again.") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"{path}: a GGUF file for the {arch!r} architecture; SDVG loads Wan 2.1 T2V DiTs "
                             "(general.architecture 'wan', city96's layout).")
    shapes, types, tensors = {}, {}, {}
    for t in reader.tensors:
        shape = _orig_shape(reader, t.name) or tuple(int(v) for v in reversed(list(t.shape)))
        kind = ggml_type(int(t.tensor_type))
        if kind.block_bytes == 0:
            raise ModelFileError(f"{path}: tensor {t.name} has a GGUF type SDVG does not know ({kind.name}).")
        shapes[t.name], types[t.name], tensors[t.name] = shape, int(t.tensor_type), t
    metadata = {"gguf.architecture": arch}
    heads = _field(reader, META_NUM_HEADS)  # written by SDVG's tiny fixtures for heads of width other than 128
    if heads is not None:
        metadata[META_NUM_HEADS] = int(heads)
    return GGUFContents(path, shapes, types, metadata, tensors)
