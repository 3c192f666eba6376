"""``python -m sdvg inspect FILE``: what a model file is, from its header and key names, without loading it.

A safetensors file is described from its header alone (plain reads: a 28.6 GB 14B inspects in a fraction of a
second); a torch pickle is opened memory-mapped with ``weights_only=True``. Wan DiTs get the full description (size,
layers, dtype, key layout, prefix, training-dict entry, the memory each weight dtype needs); any other file is named
by the same guess the loaders use ("a Wan VAE, which goes in models/vae/").
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from ..errors import ModelFileError
from ..memory import GB
from .checkpoint import load_checkpoint, looks_like
from .file_checks import SAFETENSORS_SUFFIXES, check_not_foreign, require_path
from .safetensors_io import read_safetensors_header


def describe_model_file(path: str | Path) -> str:
    """A few lines on ``path``: its kind, size, dtypes and layout (raises ModelFileError for what is no model)."""
    from .wan import inspect_dit_checkpoint

    path = Path(path)
    require_path(path, f"{path} does not exist.")
    if path.is_file():
        check_not_foreign(path)
    try:
        info = inspect_dit_checkpoint(path)
    except ModelFileError:
        if path.is_dir() or path.name.lower().endswith(".gguf"):  # a GGUF is a DiT here or says what it is
            raise
        return _describe_other(path)
    n = info.num_params
    if info.quantized:
        memory = _quantized_memory(info)
    else:
        memory = (f"  {info.num_tensors} tensors, {n / 1e9:.3f} B parameters; the weights need about {_size(2 * n)} in "
                  f"bf16/fp16, {_size(4 * n)} in fp32, {_size(n)} as fp8_e4m3fn")
    return "\n".join([f"{path}: {info.summary()}", memory, f"  files: {', '.join(info.files)}"])


def _quantized_memory(info) -> str:
    """A GGUF / scaled-fp8 DiT: its stored types and what its weights take on the device in either role."""
    import torch

    n = info.num_params
    types = ", ".join(f"{k} ({v} tensors)" for k, v in sorted(info.quant.items(), key=lambda kv: -kv[1]))
    gpu, cpu = info.device_bytes(torch.bfloat16), info.device_bytes(torch.float32)
    return (f"  {info.num_tensors} tensors, {n / 1e9:.3f} B parameters; stored as {types}, the rest unquantized "
            f"({_size(info.stored_bytes)} in the file)\n"
            f"  as the target or drafter the weights stay quantized on the device and each layer is dequantized in "
            f"its forward: about {_size(gpu)} on a GPU (bf16 compute), {_size(cpu)} on the CPU (fp32 compute); "
            f"dequantized it would be {_size(2 * n)} in bf16")


def _is_lora(path: Path) -> bool:
    keys = (read_safetensors_header(path).shapes if path.name.lower().endswith(SAFETENSORS_SUFFIXES)
            else load_checkpoint(path).tensors)
    return "LoRA" in looks_like(keys)


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def _describe_other(path: Path) -> str:
    from .lora import describe_lora

    lora = describe_lora(path) if _is_lora(path) else None
    if lora is not None:
        return lora
    if path.name.lower().endswith(SAFETENSORS_SUFFIXES):
        header = read_safetensors_header(path)
        shapes, dtypes, entry = header.shapes, header.dtypes, None
    else:
        ck = load_checkpoint(path)  # a pickle: memory-mapped, weights_only
        shapes = {k: tuple(v.shape) for k, v in ck.tensors.items()}
        dtypes = {k: v.dtype for k, v in ck.tensors.items()}
        entry = ck.entry
    params = sum(math.prod(s) for s in shapes.values())
    by_dtype = Counter()
    for key, shape in shapes.items():
        by_dtype[str(dtypes.get(key)).replace("torch.", "")] += math.prod(shape)
    mix = ", ".join(f"{d} {n / params:.0%}" for d, n in by_dtype.most_common(3)) if params else "no tensors"
    return "\n".join([
        f"{path}: {looks_like(shapes, entry=entry)}",
        f"  {len(shapes)} tensors, {params / 1e9:.3f} B parameters ({mix})",
    ])
