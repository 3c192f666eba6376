"""A causal DiT built from weights another program already holds (a ComfyUI ``MODEL``), one tensor at a time.

The caller gives the original-layout (Wan repository) key → shape map and a ``read(key)`` that returns one tensor
(already patched, e.g. with a LoRA, if it wants); each tensor is converted on its way to the device, so the peak is
the new model plus one tensor. The config comes from the shapes; the head count from the caller (it is not in the
shapes), as for a file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..devices import FP8_STORAGE, default_compute_dtype, parse_dtype, resolve_device
from ..errors import ConfigError, ModelFileError
from ..memory import GB, check_fits
from ..models.dit import CausalWanTransformer
from ..models.quant import PLAIN_GGML, QuantTensor, ScaledFP8
from .safetensors_io import ReadOnAccess
from .wan import build_dit_from_state_dict
from .wan_keys import config_from_shapes, original_to_diffusers_names, size_label

logger = logging.getLogger(__name__)



def core_weight(value, scale: torch.Tensor | None = None):
    """One weight a host holds, in the form SDVG keeps it: a ComfyUI-GGUF ``GGMLTensor`` (``tensor_type``,
    ``tensor_shape``) of a quantized type → :class:`QuantTensor` (its bytes, no copy); a float8 weight with a scale
    → :class:`ScaledFP8`; a host's quantized-tensor subclass (``QuantizedTensor``) → its ``dequantize()``; anything
    else as it is."""
    qtype = getattr(value, "tensor_type", None)
    if qtype is not None and int(qtype) not in PLAIN_GGML:
        shape = tuple(int(d) for d in value.tensor_shape)
        return QuantTensor(value.as_subclass(torch.Tensor).reshape(shape[0] if len(shape) > 1 else 1, -1),
                           int(qtype), shape)
    if qtype is not None:
        return value.as_subclass(torch.Tensor)
    if scale is not None:
        return ScaledFP8(value.as_subclass(torch.Tensor), scale.to(torch.float32))
    if type(value) is not torch.Tensor and type(value).__name__ == "QuantizedTensor":
        return value.dequantize()
    return value


def core_nbytes(value) -> int:
    """Bytes a host's weight takes as stored (a GGMLTensor's bytes, not its logical shape's)."""
    if isinstance(value, torch.Tensor):
        return value.as_subclass(torch.Tensor).numel() * value.element_size()
    return 0


def dit_from_weights(read: Callable[[str], torch.Tensor], shapes: dict[str, tuple[int, ...]], *,
                     heads: int | None, stored_dtype: torch.dtype, dtype: str | torch.dtype = "auto",
                     device: str | torch.device = "cpu", name: str = "MODEL",
                     quantized_bytes: int | None = None) -> CausalWanTransformer:
    """``CausalWanTransformer`` from original-keyed weights (see the module docstring).

    dtype: ``auto`` (the weights' own bf16/fp16 on CUDA, fp32 on CPU), ``bf16``, ``fp16``, ``fp32`` or
    ``fp8_e4m3fn`` (fp8 storage, bf16 compute). ``read`` may return stored-form weights (:func:`core_weight`): they
    stay quantized, and ``quantized_bytes`` (the weights' bytes as stored) is what the fit check counts."""
    dev = resolve_device(device, what="DiT")
    config = config_from_shapes(shapes, "original", heads_hint=heads, name=name)
    if config["in_channels"] != 16 or config["out_channels"] != 16:
        raise ModelFileError(
            f"{name}: a DiT with {config['in_channels']} input / {config['out_channels']} output channels; SDVG needs "
            "a Wan 2.1 T2V model on the 16-channel Wan 2.1 VAE latent space."
        )
    default = stored_dtype if dev.type == "cuda" and stored_dtype in (torch.bfloat16, torch.float16) else \
        default_compute_dtype(dev)
    chosen = parse_dtype(dtype, default=default)
    fp8 = chosen == FP8_STORAGE and quantized_bytes is None
    param_dtype = torch.bfloat16 if chosen == FP8_STORAGE else chosen
    if not isinstance(param_dtype, torch.dtype):
        raise ConfigError(f"Unknown weight dtype {dtype!r}.")
    count = sum(int(torch.Size(s).numel()) for s in shapes.values())
    check_fits(f"{name} ({size_label(config)}, {count / 1e9:.2f} B parameters)",
               quantized_bytes or count * (1 if fp8 else param_dtype.itemsize), dev,
               options="" if fp8 else f"As {FP8_STORAGE} weights it needs about {count / GB:.1f} GB.")
    renamed = original_to_diffusers_names(shapes)
    weights = ReadOnAccess({new: old for old, new in renamed.items()}, read, torch.device("cpu"))
    model = build_dit_from_state_dict(weights, config, dtype=param_dtype, device=dev, fp8_storage=fp8, name=name)
    logger.info("built %s from %s as %s on %s", size_label(config), name, FP8_STORAGE if fp8 else param_dtype, dev)
    return model
