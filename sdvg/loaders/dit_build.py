"""A ``CausalWanTransformer`` built from a diffusers-keyed mapping of tensors, one tensor at a time.

The model is built with its parameters on the meta device and filled with ``load_state_dict(strict=True,
assign=True)``, so the peak memory stays near one copy of the weights. Values may be plain tensors or weights in
stored form (a GGUF :class:`~sdvg.models.quant.QuantTensor`, a :class:`~sdvg.models.quant.ScaledFP8`): a stored
Linear weight with a torch kernel stays in stored form (its layer becomes a ``QuantLinear``); any other stored
tensor (a convolution, a layer kept in fp32, a ggml type without a kernel) is dequantized once, here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError
from ..models.dit import CausalWanTransformer
from ..models.quant import GGML_TYPES, QuantTensor, ggml_type, has_kernel, is_stored_quant, quant_linear_like
from . import checkpoint
from .checkpoint import parameters_on_meta
from .wan_keys import diffusers_to_original_key

logger = logging.getLogger(__name__)


def empty_dit(config: dict[str, Any]) -> CausalWanTransformer:
    """``CausalWanTransformer(**config)`` with its parameters on the meta device, ready for an assigned state dict."""
    with parameters_on_meta():
        return CausalWanTransformer(**config)


def _keeps_fp32(model: nn.Module, name: str) -> bool:
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    return any(m in name.split(".") for m in keep)


def target_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Per-parameter dtype: ``dtype``, except modules the model class keeps in fp32 (``_keep_in_fp32_modules``,
    as diffusers does) when loading in half precision."""
    half = dtype in (torch.float16, torch.bfloat16)
    return {name: torch.float32 if half and _keeps_fp32(model, name) else dtype for name, _ in model.named_parameters()}


def _check_keys(model: nn.Module, state_dict, config: dict[str, Any], name: str) -> None:
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {checkpoint.first_keys([diffusers_to_original_key(k) for k in missing], 4)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {checkpoint.first_keys(unexpected, 4)})")
    raise ModelFileError(
        f"{name}: the weights do not match a Wan 2.1 T2V DiT with dim "
        f"{config['num_attention_heads'] * config['attention_head_dim']} and {config['num_layers']} layers: "
        f"{'; '.join(parts)}. The file is incomplete or a different model variant."
    )


def to_fp8_storage(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Give a (meta) model the parameter dtypes of fp8 storage: the layers diffusers' layerwise casting handles as
    float8_e4m3fn (computed in ``dtype``), the rest in ``dtype`` / fp32 as :func:`target_dtypes` says."""
    for pname, want in target_dtypes(model, dtype).items():  # meta: free
        mod_name, _, attr = pname.rpartition(".")
        mod = model.get_submodule(mod_name)
        setattr(mod, attr, nn.Parameter(getattr(mod, attr).to(want), requires_grad=False))
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)


def stays_stored(original_key: str, shape, type_name: str) -> bool:
    """Whether a stored tensor (original Wan key, ``type_name`` a ggml type or ``fp8_scaled``) stays in stored form
    on the device, by the rule :func:`_stays_quantized` applies to the built model: 2-D Linear weights outside the
    fp32 time embedding whose type has a kernel. For sizes before a load (inspect, fit checks, the README table)."""
    kernels = {ggml_type(t).name for t in GGML_TYPES if has_kernel(t)} | {"fp8_scaled"}
    return len(shape) == 2 and not original_key.startswith("time_embedding.") and type_name in kernels


def stored_form_bytes(shapes: dict[str, tuple[int, ...]], kind: str) -> dict[str, int]:
    """Device bytes per original key of a DiT whose stored tensors are all of ``kind`` (a ggml type with a kernel, or
    ``fp8_scaled``): the tensors that stay stored (:func:`stays_stored`) at their stored size (fp8: 1 byte a weight
    and a float32 scale), the rest in bf16 (the time embedding in fp32)."""
    row = {t.name: t for t in GGML_TYPES.values()}
    out = {}
    for key, shape in shapes.items():
        n = math.prod(shape)
        if not stays_stored(key, shape, kind):
            out[key] = n * (4 if key.startswith("time_embedding.") else 2)
        else:
            out[key] = n + 4 if kind == "fp8_scaled" else shape[0] * row[kind].row_bytes(shape[1])
    return out


def _stays_quantized(model: nn.Module, key: str, value) -> nn.Linear | None:
    """The Linear layer a stored weight ``key`` can stay quantized in, or None (it is dequantized at load)."""
    if not key.endswith(".weight"):
        return None
    layer = model.get_submodule(key[: -len(".weight")])
    if type(layer) is not nn.Linear or _keeps_fp32(model, key):
        return None
    if isinstance(value, QuantTensor) and not has_kernel(value.qtype):
        return None
    return layer


def _place_stored(model: nn.Module, key: str, value, want: torch.dtype, dev: torch.device,
                  kept: Counter) -> dict[str, torch.Tensor]:
    """A stored weight → the state-dict entries for it (its layer swapped for a QuantLinear when it stays stored)."""
    if dev.type != "meta":
        value = value.to(dev)
    layer = _stays_quantized(model, key, value)
    if layer is None:
        kept["dequantized at load: " + value.type_name] += 1
        return {key: value.dequantize(want) if dev.type != "meta" else torch.empty(value.shape, dtype=want,
                                                                                     device="meta")}
    module_name = key[: -len(".weight")]
    parent_name, _, child = module_name.rpartition(".")
    scale = getattr(value, "scale", None)
    setattr(model.get_submodule(parent_name), child, quant_linear_like(layer, value.data, value.qtype, scale))
    kept[value.type_name] += 1
    out = {key: value.data}
    if scale is not None:
        out[module_name + ".scale"] = scale.to(torch.float32)
    return out


def build_dit_from_state_dict(
    state_dict,
    config: dict[str, Any],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    fp8_storage: bool = False,
    name: str = "checkpoint",
) -> CausalWanTransformer:
    """Build ``CausalWanTransformer(**config)`` with meta parameters and assign the diffusers-keyed ``state_dict``
    (strict). Tensors that already have the wanted dtype and device are used as they are (no copy); others are
    converted one at a time. ``fp8_storage``: the layers diffusers' layerwise casting handles are stored as
    float8_e4m3fn (computed in ``dtype``, bf16 by default), converted tensor by tensor so the peak stays near the
    fp8 size. Stored-form values (see the module docstring) keep their form where a QuantLinear can hold them."""
    model = empty_dit(config)
    dev = torch.device(device)
    _check_keys(model, state_dict, config, name)
    if fp8_storage:
        dtype = dtype or torch.bfloat16
        to_fp8_storage(model, dtype)
        targets = {k: p.dtype for k, p in model.named_parameters()}
    else:
        targets = target_dtypes(model, dtype) if dtype is not None else {}
    ready, kept = {}, Counter()
    for k in list(state_dict):
        v = state_dict[k]
        if is_stored_quant(v):
            ready.update(_place_stored(model, k, v, targets.get(k, dtype or torch.float32), dev, kept))
            continue
        want = targets.get(k, v.dtype) if v.is_floating_point() else v.dtype
        ready[k] = v.to(dtype=want) if v.device.type == "meta" or dev.type == "meta" else v.to(device=dev, dtype=want)
    try:
        model.load_state_dict(ready, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{name}: the tensor shapes do not match the inferred config ({exc}).") from exc
    if kept:
        logger.info("%s: layers in stored form: %s", name, ", ".join(f"{k} ×{n}" for k, n in sorted(kept.items())))
    if dev.type != "meta":
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return model
