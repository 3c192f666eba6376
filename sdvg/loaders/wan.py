"""Wan 2.1 text-to-video DiT checkpoints: inspect and load every common file format into ``CausalWanTransformer``.

Accepted inputs (see ``docs`` / README for the table):

* single ``.safetensors`` files with the original Wan key names, bare or behind a prefix (``model.`` as in
  Krea Realtime 14B, ``model.diffusion_model.`` / ``diffusion_model.`` as in Comfy-Org repackages), or with
  diffusers key names;
* torch pickles (``.pt``/``.pth``/``.ckpt``/``.bin``) holding ``{"generator_ema", "generator", ...}`` (Self-Forcing,
  CausVid; ``generator_ema`` preferred), ``{"state_dict"|"model"|"module": sd}`` or a plain state dict; always read
  with ``weights_only=True`` (and ``mmap=True`` when the file allows it);
* diffusers folders (``config.json`` + ``diffusion_pytorch_model*.safetensors``, sharded index included), also a
  pipeline root holding ``transformer/``;
* GGUF files in city96's layout (``gguf_file.py``) and scaled-fp8 safetensors (``scaled_fp8.py``): their quantized
  weights stay in stored form on the device (``models/quant.py``), dequantized per layer in the forward.

The model is built with its parameters on the meta device and filled with ``load_state_dict(strict=True,
assign=True)``, so the peak memory stays near one copy of the weights. Every failure is a ``ModelFileError``
naming the file and what was found in it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..devices import FP8_STORAGE, default_compute_dtype, parse_dtype, resolve_device
from ..errors import ModelFileError
from ..models.dit import CausalWanTransformer, dit_param_shapes
from ..models.offload import DEFAULT_RESERVE_BYTES, check_dit_fits, offload_model
from ..models.quant import PLAIN_GGML
from . import checkpoint
from .checkpoint import describe_keys, looks_like, prefix_before, torch_load, unwrap_state_dict
from .dit_build import (  # noqa: F401 - build_dit_from_state_dict, empty_dit, target_dtypes, to_fp8_storage re-exported
    build_dit_from_state_dict,
    empty_dit,
    stays_stored,
    target_dtypes,
    to_fp8_storage,
)
from .file_checks import require_path
from .gguf_file import open_gguf
from .lora import LoraFile, LoraSpec, MergedTensors, prepare_loras
from .safetensors_io import LazyTensors, ReadOnAccess, read_safetensors_header
from .scaled_fp8 import FP8_DTYPES, SCALE_MARKERS, find_scales, stored_nbytes, with_scales
from .wan_keys import (
    META_NUM_HEADS,
    config_from_diffusers,
    config_from_shapes,
    original_to_diffusers_names,
    size_label,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DiTCheckpointInfo",
    "inspect_dit_checkpoint",
    "load_dit",
    "build_dit_from_state_dict",
    "read_dit_state_dict",
    "empty_dit",
    "target_dtypes",
]

PT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
KNOWN_PREFIXES = (
    "",
    "model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "model.model.",
    "module.",
    "model.module.",
    "generator.",
    "transformer.",
    "net.",
)
# keys of other components that all-in-one checkpoints carry beside the DiT; ignored when the DiT has a prefix
SIBLING_PREFIXES = ("first_stage_model.", "cond_stage_model.", "conditioner.", "vae.", "text_encoder.", "text_encoders.")



@dataclass
class DiTCheckpointInfo:
    """What a DiT file holds, read from headers/shapes only (a 28 GB safetensors inspects instantly)."""

    path: str
    format: str  # "safetensors" | "pt" | "diffusers-dir"
    key_layout: str  # "original" | "diffusers"
    prefix: str  # the prefix stripped from every key ("" when bare)
    pt_key: str | None  # the dict entry of a torch pickle that held the weights ("generator_ema", ...)
    config: dict[str, Any]  # WanTransformer3DModel / CausalWanTransformer constructor arguments
    size_label: str  # "1.3B" | "14B" | "custom: dim D, L layers"
    num_params: int
    dtype: str  # the dtype holding most parameters, e.g. "bfloat16"
    fp8: bool  # some weights are stored as float8
    scaled_fp8: bool  # Comfy "scaled fp8" (scale_weight / weight_scale keys): kept as fp8 + scale
    num_tensors: int
    files: list[str] = field(default_factory=list)  # the weight files read (several for sharded folders)
    quant: dict[str, int] = field(default_factory=dict)  # stored type → tensor count (GGUF types, fp8_scaled)
    stored_bytes: int = 0  # bytes of the DiT's tensors in the file
    quant_bytes: int = 0  # bytes of the quantized tensors (with their scales)
    quant_params: int = 0  # parameters in the quantized tensors
    fp32_params: int = 0  # parameters of the time embedding (fp32 beside bf16/fp16, as diffusers keeps it)

    def device_bytes(self, dtype: torch.dtype) -> int:
        """The weights' bytes on the device: the tensors that stay quantized as stored, the rest in ``dtype`` (the
        time embedding in fp32 beside half precision)."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.quant_bytes + (self.num_params - self.quant_params) * size + self.fp32_params * (4 - size)

    @property
    def quantized(self) -> bool:
        """GGUF or scaled fp8: weights that stay in stored form on the device (``models/quant.py``)."""
        return bool(self.quant)

    @property
    def dim(self) -> int:
        return int(self.config["num_attention_heads"] * self.config["attention_head_dim"])

    def summary(self) -> str:
        layers = self.config["num_layers"]
        return (
            f"Wan 2.1 T2V DiT {self.size_label} ({self.num_params / 1e9:.2f}B params, dim {self.dim}, {layers} layers, "
            f"{self.config['num_attention_heads']} heads, {self._types()}) "
            f"from {self.format} [{self.key_layout} keys, prefix {self.prefix!r}"
            f"{', ' + self.pt_key if self.pt_key else ''}]"
        )

    def _types(self) -> str:
        if self.quant:
            return ", ".join(f"{k} ×{n}" for k, n in sorted(self.quant.items(), key=lambda kv: -kv[1]))
        return self.dtype + (", fp8" if self.fp8 else "")


# ----------------------------------------------------------------------------------------------------------
# reading files


@dataclass
class _Source:
    path: Path
    format: str
    files: list[Path]
    shapes: dict[str, tuple[int, ...]]  # raw keys (as in the file)
    dtypes: dict[str, torch.dtype | None]
    metadata: dict[str, Any]
    pt_key: str | None = None
    key_file: dict[str, Path] = field(default_factory=dict)  # safetensors: key → shard
    tensors: dict[str, torch.Tensor] | None = None  # pickles: the loaded (mmapped) tensors
    diffusers_config: dict[str, Any] | None = None
    reader: Any = None  # GGUF: raw key → tensor or QuantTensor
    quant: dict[str, str] = field(default_factory=dict)  # raw key → stored type (quantized tensors only)
    scales: dict[str, str] = field(default_factory=dict)  # scaled fp8: raw weight key → raw scale key
    nbytes: dict[str, int] = field(default_factory=dict)  # raw key → stored bytes (when known)
    types: dict[str, int] = field(default_factory=dict)  # GGUF: raw key → ggml type number

    def tensors_by_name(self, names: dict[str, str], device: torch.device) -> Mapping[str, torch.Tensor]:
        """``{name: raw key}`` → a mapping whose ``[name]`` reads that tensor (safetensors: from its shard with plain
        reads, then onto ``device``; pickles: the mmapped tensor). Nothing is read before it is asked for."""
        if self.tensors is not None:
            return {name: self.tensors[raw] for name, raw in names.items()}
        if self.reader is not None:
            return ReadOnAccess(names, self.reader, device)
        shards = {f: LazyTensors(read_safetensors_header(f)) for f in dict.fromkeys(self.key_file.values())}
        return ReadOnAccess(names, lambda raw: shards[self.key_file[raw]][raw], device)


def _resolve_diffusers_dir(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    if (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    entries = sorted(p.name for p in path.iterdir())[:12]
    raise ModelFileError(
        f"{path}: a folder without config.json (found: {', '.join(entries) or 'nothing'}). A diffusers transformer "
        "folder needs config.json plus diffusion_pytorch_model*.safetensors; or pass a single checkpoint file."
    )


def _open_source(path: str | os.PathLike, pt_weights: str = "ema") -> _Source:
    p = Path(path).expanduser()
    require_path(p, f"DiT checkpoint not found: {p}. Put the file there (e.g. models/diffusion_models/) or fix the "
                    "path.")
    if p.is_dir():
        return _open_diffusers_dir(_resolve_diffusers_dir(p))
    name = p.name.lower()
    if name.endswith(".gguf"):
        g = open_gguf(p)
        quant = {k: g.type_name(k) for k, t in g.types.items() if t not in PLAIN_GGML}
        return _Source(p, "gguf", [p], g.shapes, {k: PLAIN_GGML.get(t) for k, t in g.types.items()}, g.metadata,
                       reader=g.read, quant=quant, nbytes={k: g.stored_bytes(k) for k in g.shapes}, types=g.types)
    if name.endswith(".safetensors"):
        header = read_safetensors_header(p)
        header.require_complete()
        shapes = header.shapes
        return _Source(p, "safetensors", [p], shapes, header.dtypes, dict(header.metadata),
                       key_file=dict.fromkeys(shapes, p), nbytes=stored_nbytes(shapes, header.dtypes))
    if name.endswith(PT_SUFFIXES):
        ck = unwrap_state_dict(torch_load(p), p, pt_weights=pt_weights)
        tensors = ck.tensors
        return _Source(
            p, "pt", [p], {k: tuple(v.shape) for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()},
            {f"sdvg.{k}": v for k, v in ck.config.items()}, pt_key=ck.entry, tensors=tensors,
        )
    raise ModelFileError(f"{p}: unknown file type {p.suffix!r}. Use .safetensors, .gguf, .pt/.pth/.ckpt or a diffusers "
                         "folder.")


def _open_diffusers_dir(folder: Path) -> _Source:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{folder / 'config.json'}: not readable JSON ({exc}).") from exc
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelFileError(f"{index}: not a valid shard index ({exc}).") from exc
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    if not files:
        found = ", ".join(sorted(x.name for x in folder.iterdir())[:12])
        raise ModelFileError(f"{folder}: diffusers folder without diffusion_pytorch_model*.safetensors (found: {found}).")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype | None] = {}
    key_file: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise ModelFileError(f"{f}: shard listed in the index is missing; download it again.")
        header = read_safetensors_header(f)
        header.require_complete()
        shapes.update(header.shapes)
        dtypes.update(header.dtypes)
        key_file.update(dict.fromkeys(header.shapes, f))
    return _Source(folder, "diffusers-dir", files, shapes, dtypes, {}, key_file=key_file, diffusers_config=config)


# ----------------------------------------------------------------------------------------------------------
# recognising the content


def _detect_layout(src: _Source) -> tuple[str, str]:
    """→ (key_layout, prefix). Strips nothing yet; ``_fsdp_wrapped_module.`` is removed before matching."""
    keys = [k.replace("_fsdp_wrapped_module.", "") for k in src.shapes]
    anchors = (
        ("original", "head.head.weight"),
        ("diffusers", "condition_embedder.time_embedder.linear_1.weight"),
    )
    for layout, anchor in anchors:
        prefix = prefix_before(keys, anchor)
        if prefix is None:
            continue
        if prefix not in KNOWN_PREFIXES:
            raise ModelFileError(
                f"{src.path}: looks like a Wan DiT but its keys start with an unknown prefix {prefix!r} "
                f"(first keys: {checkpoint.first_keys(keys, 6)}). Known prefixes: "
                f"{', '.join(repr(x) for x in KNOWN_PREFIXES)}."
            )
        return layout, prefix
    raise ModelFileError(
        f"{src.path}: not a Wan 2.1 DiT: found {describe_keys(keys)}; it looks like {looks_like(keys)}. Pick a Wan "
        "2.1 T2V diffusion model file (e.g. self_forcing_dmd.pt or krea-realtime-video-14b.safetensors)."
    )


def _strip(src: _Source, prefix: str) -> dict[str, str]:
    """raw key → stripped key for the DiT keys; complains about keys outside the prefix."""
    mapping: dict[str, str] = {}
    outside: list[str] = []
    for raw in src.shapes:
        k = raw.replace("_fsdp_wrapped_module.", "")
        if k == "scaled_fp8" or k.endswith((".scaled_fp8", *SCALE_MARKERS)) and not k.endswith(".comfy_quant"):
            continue
        if k.startswith(prefix):
            mapping[raw] = k[len(prefix) :]
        elif prefix and k.startswith(SIBLING_PREFIXES):
            continue
        else:
            outside.append(raw)
    if outside:
        raise ModelFileError(
            f"{src.path}: {len(outside)} tensors are outside the DiT prefix {prefix!r} "
            f"(e.g. {checkpoint.first_keys(outside, 4)}); this is not a plain Wan 2.1 DiT checkpoint."
        )
    return mapping



def _infer_config(src: _Source, layout: str, stripped: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    dcfg = src.diffusers_config
    if dcfg is not None and (layout == "original" or "num_attention_heads" not in dcfg):
        # an original Wan folder (Wan-AI/Wan2.1-T2V-*: config.json with dim/num_heads, original keys)
        if "num_heads" in dcfg:
            src.metadata.setdefault(META_NUM_HEADS, dcfg["num_heads"])
        dcfg = None
    if dcfg is not None:
        return config_from_diffusers(dcfg)
    return config_from_shapes(stripped, layout, heads_hint=src.metadata.get(META_NUM_HEADS), name=str(src.path))


def _inspect(src: _Source) -> tuple[DiTCheckpointInfo, dict[str, str]]:
    layout, prefix = _detect_layout(src)
    raw_to_key = find_scales(src, _strip(src, prefix))
    stripped = {k: src.shapes[raw] for raw, k in raw_to_key.items()}
    i2v = [k for k in stripped if k.startswith(("img_emb.", "condition_embedder.image_embedder")) or "k_img" in k
           or "add_k_proj" in k]
    if i2v:
        raise ModelFileError(
            f"{src.path}: this is a Wan image-to-video (I2V) DiT ({i2v[0]} …). SDVG drives text-to-video only: use a "
            "Wan 2.1 T2V checkpoint (Self-Forcing 1.3B, Krea Realtime 14B, Wan2.1-T2V-1.3B/14B)."
        )
    cfg = _infer_config(src, layout, stripped)
    by_dtype: Counter[str] = Counter()
    fp8 = False
    num_params = 0
    for raw in raw_to_key:
        n = math.prod(src.shapes[raw])
        dt = src.dtypes.get(raw)
        num_params += n
        by_dtype[src.quant.get(raw) or (str(dt).replace("torch.", "") if dt is not None else "unknown")] += n
        fp8 = fp8 or dt in FP8_DTYPES
    info = DiTCheckpointInfo(
        path=str(src.path),
        format=src.format,
        key_layout=layout,
        prefix=prefix,
        pt_key=src.pt_key,
        config=cfg,
        size_label=size_label(cfg),
        num_params=num_params,
        dtype=by_dtype.most_common(1)[0][0] if by_dtype else "unknown",
        fp8=fp8,
        scaled_fp8=bool(src.scales),
        num_tensors=len(src.shapes),
        files=[str(f) for f in src.files],
        quant=dict(Counter(src.quant[raw] for raw in raw_to_key if raw in src.quant)),
        stored_bytes=sum(src.nbytes.get(raw, 0) for raw in src.shapes),
        **_stays_stored(src, raw_to_key),
    )
    return info, raw_to_key


def _stays_stored(src: _Source, raw_to_key: dict[str, str]) -> dict[str, int]:
    """Bytes and parameters of the quantized tensors that stay in stored form on the device (the builder's rule:
    2-D Linear weights with a kernel, outside the fp32 time embedding), and the fp32 time embedding's parameters."""
    kept = [raw for raw in src.quant if raw in raw_to_key and stays_stored(raw_to_key[raw], src.shapes[raw],
                                                                            src.quant[raw])]
    return {"quant_bytes": sum(src.nbytes.get(raw, 0) + src.nbytes.get(src.scales.get(raw, ""), 0) for raw in kept),
            "quant_params": sum(math.prod(src.shapes[raw]) for raw in kept),
            "fp32_params": sum(math.prod(src.shapes[raw]) for raw, key in raw_to_key.items()
                               if key.startswith("time_embedding."))}


def inspect_dit_checkpoint(path: str | os.PathLike) -> DiTCheckpointInfo:
    """Describe a DiT checkpoint without loading its tensors (safetensors: header only; pickles: mmapped)."""
    info, _ = _inspect(_open_source(path))
    return info


# ----------------------------------------------------------------------------------------------------------
# loading


def _read_converted(
    src: _Source, info: DiTCheckpointInfo, raw_to_key: dict[str, str], device: torch.device
) -> Mapping[str, torch.Tensor]:
    if info.key_layout == "original":
        renamed = original_to_diffusers_names(raw_to_key.values())
        names = {renamed[key]: raw for raw, key in raw_to_key.items()}
    else:
        names = {key: raw for raw, key in raw_to_key.items()}
    if src.scales:
        return with_scales(src, names, device)
    return src.tensors_by_name(names, device)


def read_dit_state_dict(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], DiTCheckpointInfo]:
    """The DiT tensors of ``path`` with diffusers key names (prefix stripped, converted), plus the file's info.
    Tensors keep the stored dtype; safetensors are read straight onto ``device``, pickles stay mmapped on CPU."""
    src = _open_source(path)
    info, raw_to_key = _inspect(src)
    return dict(_read_converted(src, info, raw_to_key, torch.device(device))), info


def _resolve_dtype(dtype: str | torch.dtype | None, info: DiTCheckpointInfo, device: torch.device):
    """→ (param/compute dtype, fp8_storage flag). A GGUF / scaled-fp8 file keeps its stored form: the dtype is the
    compute dtype (auto: bf16 on CUDA, fp32 on CPU; fp8_e4m3fn: bf16)."""
    if info.quantized:
        chosen = parse_dtype(dtype, default=default_compute_dtype(device))
        return (torch.bfloat16 if chosen == FP8_STORAGE else chosen), False
    stored = getattr(torch, info.dtype, None)
    if device.type == "cuda" and stored in (torch.bfloat16, torch.float16):
        default = stored
    else:
        default = default_compute_dtype(device)
    chosen = parse_dtype(dtype, default=default)
    if (dtype is None or str(dtype).strip().lower() == "auto") and info.fp8 and device.type == "cuda":
        chosen = FP8_STORAGE
    if chosen == FP8_STORAGE:
        return torch.bfloat16, True
    return chosen, False


def load_dit(
    path: str | os.PathLike, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    loras: Sequence[LoraSpec | LoraFile] = (), offload_blocks: int | str | None = None,
    offload_reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    pt_weights: str = "ema",
) -> CausalWanTransformer:
    """Load a Wan 2.1 T2V DiT from any accepted format into ``CausalWanTransformer`` (eval mode, no grad).

    dtype: ``auto`` (bf16/fp16 files keep their dtype on CUDA, fp8 files get fp8 storage; fp32 on CPU), ``bf16``,
    ``fp16``, ``fp32``, or ``fp8_e4m3fn`` = fp8 weight storage with bf16 compute (diffusers layerwise casting).
    Modules listed in the model class's ``_keep_in_fp32_modules`` stay fp32 in bf16/fp16, as in diffusers. A GGUF or
    scaled-fp8 file keeps its quantized weights whatever ``dtype`` says; ``dtype`` is then the compute dtype (auto:
    bf16 on CUDA, fp32 on CPU) of the layers and of everything unquantized.
    loras: ``LoraSpec(path, strength)`` items merged into the weights as they are read (fp32, before any dtype or fp8
    conversion; several add up); checked against the DiT before any weight is read.
    offload_blocks: None (every block on ``device``), K (K blocks resident, the rest streamed from pinned CPU memory,
    see ``offload.py``) or ``"auto"`` (as many as fit in the free memory less ``offload_reserve_bytes``).
    ``pt_weights``: which weights of a training ``.pt`` (``ema``: ``generator_ema``; ``generator``: the reference's).
    """
    dev = resolve_device(device, what="DiT")
    src = _open_source(path, pt_weights)
    info, raw_to_key = _inspect(src)
    if info.config["in_channels"] != 16 or info.config["out_channels"] != 16:
        raise ModelFileError(
            f"{path}: a DiT with {info.config['in_channels']} input / {info.config['out_channels']} output channels; "
            "SDVG needs a Wan 2.1 T2V model on the 16-channel Wan 2.1 VAE latent space."
        )
    param_dtype, fp8 = _resolve_dtype(dtype, info, dev)
    merge = prepare_loras(loras, dit_param_shapes(info.config), what=f"{path} ({info.size_label})") if loras else None
    resident = check_dit_fits(path, info, param_dtype, fp8, dev, offload_blocks, offload_reserve_bytes)
    offload = resident is not None and resident < info.config["num_layers"]
    build_dev = torch.device("cpu") if offload else dev
    # each tensor is read when the model asks for it (plain reads, never a map of the file), gets its LoRA deltas and
    # is converted on its way to the device, so RAM holds one tensor at a time; straight to the device when nothing
    # needs converting
    direct = info.quantized or not fp8 and not info.fp8 and info.dtype == str(param_dtype).replace("torch.", "")
    sd = _read_converted(src, info, raw_to_key, build_dev if direct else torch.device("cpu"))
    if merge:
        sd = MergedTensors(sd, merge, dev)
    model = build_dit_from_state_dict(sd, info.config, dtype=param_dtype, device=build_dev, fp8_storage=fp8,
                                      name=str(path))
    del sd
    if offload:
        offload_model(model, dev, resident)
    logger.info("loaded %s as %s on %s%s%s", info.summary(), FP8_STORAGE if fp8 else param_dtype, dev,
                f", {resident} of {info.config['num_layers']} blocks resident" if offload else "",
                f", LoRAs {merge.summary()}" if merge else "")
    return model
