"""Wan 2.1 text-to-video DiT checkpoints: inspect and load every common file format into ``CausalWanTransformer``.

Accepted inputs (see ``docs`` / README for the table):

* single ``.safetensors`` files with the original Wan key names, bare or behind a prefix (``model.`` as in
  Krea Realtime 14B, ``model.diffusion_model.`` / ``diffusion_model.`` as in Comfy-Org repackages), or with
  diffusers key names;
* torch pickles (``.pt``/``.pth``/``.ckpt``/``.bin``) holding ``{"generator_ema", "generator", ...}`` (Self-Forcing,
  CausVid; ``generator_ema`` preferred), ``{"state_dict"|"model"|"module": sd}`` or a plain state dict; always read
  with ``weights_only=True`` (and ``mmap=True`` when the file allows it);
* diffusers folders (``config.json`` + ``diffusion_pytorch_model*.safetensors``, sharded index included), also a
  pipeline root holding ``transformer/``.

The model is built with its parameters on the meta device and filled with ``load_state_dict(strict=True,
assign=True)``, so the peak memory stays near one copy of the weights. Every failure is a ``ModelFileError``
naming the file and what was found in it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .devices import FP8_STORAGE, default_compute_dtype, parse_dtype, resolve_device
from .dit import CausalWanTransformer
from .errors import ModelFileError

logger = logging.getLogger(__name__)

__all__ = [
    "DiTCheckpointInfo",
    "inspect_dit_checkpoint",
    "load_dit",
    "build_dit_from_state_dict",
    "read_dit_state_dict",
    "original_key_shapes",
    "original_to_diffusers",
    "diffusers_to_original_key",
    "config_for_size",
    "write_tiny_dits",
    "TINY_DRAFTER_CONFIG",
    "TINY_TARGET_CONFIG",
    "TINY_TEXT_DIM",
]

HEAD_DIM = 128  # real Wan 2.1 DiTs (1.3B and 14B) both use 128-wide attention heads
META_NUM_HEADS = "sdvg.num_heads"  # safetensors metadata / .pt "config" entry for files whose head_dim is not 128
PT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
PT_DICT_KEYS = ("generator_ema", "generator", "state_dict", "model", "module", "ema", "net")
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

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# (original Wan name fragment, diffusers name fragment), applied in order by ``diffusers_to_original_key``;
# the inverse of diffusers' ``convert_wan_transformer_to_diffusers`` for the T2V keys (norm2 <-> norm3 swapped).
_DIFFUSERS_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)

# config values that are not in the tensor shapes; these are the values of both released Wan 2.1 T2V models
_FIXED_CONFIG = {
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
_CONFIG_KEYS = (
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    *_FIXED_CONFIG,
)


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
    scaled_fp8: bool  # Comfy "scaled fp8" (scale_weight keys): refused by load_dit
    num_tensors: int
    files: list[str] = field(default_factory=list)  # the weight files read (several for sharded folders)

    @property
    def dim(self) -> int:
        return int(self.config["num_attention_heads"] * self.config["attention_head_dim"])

    def summary(self) -> str:
        layers = self.config["num_layers"]
        return (
            f"Wan 2.1 T2V DiT {self.size_label} ({self.num_params / 1e9:.2f}B params, dim {self.dim}, {layers} layers, "
            f"{self.config['num_attention_heads']} heads, {self.dtype}{', fp8' if self.fp8 else ''}) "
            f"from {self.format} [{self.key_layout} keys, prefix {self.prefix!r}"
            f"{', ' + self.pt_key if self.pt_key else ''}]"
        )


# ----------------------------------------------------------------------------------------------------------
# key layouts


def diffusers_to_original_key(key: str) -> str:
    """Map one diffusers ``WanTransformer3DModel`` key to the original Wan 2.1 name."""
    if key == "scale_shift_table":
        return "head.modulation"
    if key.startswith("proj_out."):
        return "head.head." + key[len("proj_out.") :]
    out = key
    for src, dst in _DIFFUSERS_TO_ORIGINAL:
        out = out.replace(src, dst)
    return out.replace("scale_shift_table", "modulation")


def original_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan keys (no prefix) → diffusers keys via diffusers' own single-file converter. Tensors are not
    copied; the input dict is left untouched."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state_dict))


def config_for_size(size: str) -> dict[str, Any]:
    """The constructor config of the released 1.3B / 14B Wan 2.1 T2V DiTs."""
    dims = {"1.3B": (12, 8960, 30), "14B": (40, 13824, 40)}
    if size not in dims:
        raise ValueError(f"unknown Wan 2.1 size {size!r}; use '1.3B' or '14B'")
    heads, ffn, layers = dims[size]
    return _make_config(heads, HEAD_DIM, 16, 16, 4096, 256, ffn, layers, (1, 2, 2))


def _make_config(heads, head_dim, in_ch, out_ch, text_dim, freq_dim, ffn, layers, patch) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "patch_size": tuple(int(p) for p in patch),
        "num_attention_heads": int(heads),
        "attention_head_dim": int(head_dim),
        "in_channels": int(in_ch),
        "out_channels": int(out_ch),
        "text_dim": int(text_dim),
        "freq_dim": int(freq_dim),
        "ffn_dim": int(ffn),
        "num_layers": int(layers),
    }
    cfg.update(_FIXED_CONFIG)
    return cfg


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create module parameters on the meta device (no memory, no init cost); buffers such as the RoPE tables stay
    real because they are computed in ``__init__`` and are not part of the state dict."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(module._parameters[name])
            module._parameters[name] = cls(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _empty_model(config: dict[str, Any]) -> CausalWanTransformer:
    with parameters_on_meta():
        return CausalWanTransformer(**config)


def original_key_shapes(config: dict[str, Any]) -> dict[str, list[int]]:
    """Exact original-format key → shape of a DiT with ``config``, derived from the diffusers module tree on the
    meta device and our reverse rename map (no memory is used)."""
    with torch.device("meta"):
        model = CausalWanTransformer(**config)
    return {diffusers_to_original_key(k): list(v.shape) for k, v in model.state_dict().items()}


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

    def read(self, keys: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        if self.tensors is not None:
            return {k: self.tensors[k] for k in keys}
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.key_file[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        dev = "cpu" if device.type == "meta" else str(device)
        for file, ks in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device=dev) as f:
                    for k in ks:
                        out[k] = f.get_tensor(k)
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise ModelFileError(f"{file}: could not read the tensors ({exc}). The file looks truncated or corrupt; "
                                     "download it again.") from exc
        return out


def _read_safetensors_header(file: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype | None], dict]:
    from safetensors import safe_open

    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"only {size} bytes")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise ValueError(f"the header claims {header_len} bytes but the file has {size}")
        with open(file, "rb") as fh:
            fh.seek(8)
            header = json.loads(fh.read(header_len))
        data_len = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + data_len > size:
            raise ValueError(f"the tensors need {8 + header_len + data_len} bytes but the file has only {size}")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelFileError(
            f"{file}: not a readable safetensors file ({exc}). It is truncated or corrupt (an interrupted download?); "
            "download it again."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError
        raise ModelFileError(f"{file}: not a readable safetensors file ({exc}); download it again.") from exc
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype | None] = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        shapes[k] = tuple(int(s) for s in v["shape"])
        dtypes[k] = SAFETENSORS_DTYPES.get(v["dtype"])
    return shapes, dtypes, dict(meta)


def _torch_load(file: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (never executes code from the file), mmapped when possible."""
    try:
        try:
            return torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(
            f"{file}: refused to load. The pickle holds code or objects that are not plain tensors, so the safe loader "
            f"(torch.load weights_only=True) rejected it ({first}). SDVG never runs code from model files: use a "
            ".safetensors version of this checkpoint or a plain tensor state dict."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ModelFileError(
            f"{file}: could not read the torch checkpoint ({type(exc).__name__}: {exc}). The file is truncated or "
            "corrupt (an interrupted download?) or not a torch checkpoint; download it again."
        ) from exc


def _split_pt(file: Path, obj: Any) -> tuple[dict[str, torch.Tensor], str | None, dict[str, Any]]:
    if not isinstance(obj, dict):
        raise ModelFileError(f"{file}: the checkpoint holds a {type(obj).__name__}, not a dict of tensors.")
    extra: dict[str, Any] = {}
    cfg = obj.get("config")
    if isinstance(cfg, dict):
        extra = dict(cfg)
    pt_key = None
    for name in PT_DICT_KEYS:
        inner = obj.get(name)
        if isinstance(inner, dict) and any(torch.is_tensor(v) for v in inner.values()):
            obj, pt_key = inner, name
            break
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and torch.is_tensor(v)}
    if not tensors:
        raise ModelFileError(
            f"{file}: no tensors found (top-level entries: {', '.join(map(str, list(obj)[:8]))}). Expected a state dict "
            "or a dict with 'generator_ema' / 'generator'."
        )
    if pt_key is None and "config" in obj:
        extra = dict(obj["config"]) if isinstance(obj["config"], dict) else extra
    return tensors, pt_key, extra


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


def _open_source(path: str | os.PathLike) -> _Source:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"DiT checkpoint not found: {p}. Put the file there (e.g. models/diffusion_models/) or fix "
                             "the path.")
    if p.is_dir():
        return _open_diffusers_dir(_resolve_diffusers_dir(p))
    name = p.name.lower()
    if name.endswith(".safetensors"):
        shapes, dtypes, meta = _read_safetensors_header(p)
        return _Source(p, "safetensors", [p], shapes, dtypes, meta, key_file=dict.fromkeys(shapes, p))
    if name.endswith(PT_SUFFIXES):
        tensors, pt_key, extra = _split_pt(p, _torch_load(p))
        return _Source(
            p, "pt", [p], {k: tuple(v.shape) for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()},
            {f"sdvg.{k}": v for k, v in extra.items()}, pt_key=pt_key, tensors=tensors,
        )
    raise ModelFileError(f"{p}: unknown file type {p.suffix!r}. Use .safetensors, .pt/.pth/.ckpt or a diffusers folder.")


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
        s, d, _ = _read_safetensors_header(f)
        shapes.update(s)
        dtypes.update(d)
        key_file.update(dict.fromkeys(s, f))
    return _Source(folder, "diffusers-dir", files, shapes, dtypes, {}, key_file=key_file, diffusers_config=config)


# ----------------------------------------------------------------------------------------------------------
# recognising the content


def _describe_foreign(keys: list[str]) -> str:
    """A short guess at what a non-DiT checkpoint is, for error messages."""
    joined = "\n".join(keys)

    def has(pattern: str) -> bool:
        return re.search(pattern, joined, re.MULTILINE) is not None

    guesses = (
        (r"lora_(up|down|A|B)|\.lora\.|\.alpha$", "a LoRA (an add-on, not a full DiT)"),
        (r"spiece_model|encoder\.block\.\d+\.layer|^shared\.weight", "a UMT5/T5 text encoder"),
        (r"decoder\.middle\.0\.residual|decoder\.up_blocks|^(first_stage_model\.)?(decoder|encoder)\.", "a VAE"),
        (r"token_embedding\.weight|blocks\.\d+\.attn\.q\.|blocks\.\d+\.pos_embedding", "the Wan UMT5 text encoder (.pth)"),
        (r"^blip\.|^mlp\.layers", "an ImageReward checkpoint"),
        (r"visual\.|vision_model\.|textual\.", "a CLIP model"),
        (r"vace_blocks|vace_patch_embedding", "a Wan VACE model"),
        (r"double_blocks|single_blocks|joint_blocks|input_blocks\.\d+", "a different diffusion model (Flux/SD3/SD UNet)"),
    )
    for pattern, what in guesses:
        if has(pattern):
            return what
    return "an unknown model"


def _first_keys(keys: list[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (", …" if len(keys) > n else "")


def _detect_layout(src: _Source) -> tuple[str, str]:
    """→ (key_layout, prefix). Strips nothing yet; ``_fsdp_wrapped_module.`` is removed before matching."""
    keys = [k.replace("_fsdp_wrapped_module.", "") for k in src.shapes]
    anchors = (
        ("original", "head.head.weight"),
        ("diffusers", "condition_embedder.time_embedder.linear_1.weight"),
    )
    for layout, anchor in anchors:
        hits = [k[: -len(anchor)] for k in keys if k.endswith(anchor) and (not k[: -len(anchor)] or k[-len(anchor) - 1] == ".")]
        if not hits:
            continue
        prefix = sorted(hits, key=len)[0]
        if prefix not in KNOWN_PREFIXES:
            raise ModelFileError(
                f"{src.path}: looks like a Wan DiT but its keys start with an unknown prefix {prefix!r} "
                f"(first keys: {_first_keys(sorted(keys))}). Known prefixes: "
                f"{', '.join(repr(x) for x in KNOWN_PREFIXES)}."
            )
        return layout, prefix
    what = _describe_foreign(sorted(keys))
    raise ModelFileError(
        f"{src.path}: not a Wan 2.1 DiT: found {len(keys)} tensors, looks like {what} "
        f"(first keys: {_first_keys(sorted(keys))}). Pick a Wan 2.1 T2V diffusion model file "
        "(e.g. self_forcing_dmd.pt or krea-realtime-video-14b.safetensors)."
    )


def _strip(src: _Source, prefix: str) -> dict[str, str]:
    """raw key → stripped key for the DiT keys; complains about keys outside the prefix."""
    mapping: dict[str, str] = {}
    outside: list[str] = []
    for raw in src.shapes:
        k = raw.replace("_fsdp_wrapped_module.", "")
        if k.startswith(prefix):
            mapping[raw] = k[len(prefix) :]
        elif prefix and k.startswith(SIBLING_PREFIXES):
            continue
        elif k == "scaled_fp8" or k.endswith((".scale_input",)):
            continue
        else:
            outside.append(raw)
    if outside:
        raise ModelFileError(
            f"{src.path}: {len(outside)} tensors are outside the DiT prefix {prefix!r} "
            f"(e.g. {_first_keys(sorted(outside), 4)}); this is not a plain Wan 2.1 DiT checkpoint."
        )
    return mapping


def _is_scaled_fp8(keys: list[str]) -> bool:
    return any(k == "scaled_fp8" or k.endswith(("scale_weight", ".scale_input")) for k in keys)


def _infer_config(src: _Source, layout: str, stripped: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    dcfg = src.diffusers_config
    if dcfg is not None and (layout == "original" or "num_attention_heads" not in dcfg):
        # an original Wan folder (Wan-AI/Wan2.1-T2V-*: config.json with dim/num_heads, original keys)
        if "num_heads" in dcfg:
            src.metadata.setdefault(META_NUM_HEADS, dcfg["num_heads"])
        dcfg = None
    if dcfg is not None:
        cfg = dict(_FIXED_CONFIG)
        cfg.update({k: v for k, v in dcfg.items() if k in _CONFIG_KEYS})
        if "patch_size" in cfg:
            cfg["patch_size"] = tuple(cfg["patch_size"])
        return cfg
    if layout == "original":
        names = {
            "text": "text_embedding.0.weight",
            "time": "time_embedding.0.weight",
            "ffn": "blocks.0.ffn.0.weight",
            "out": "head.head.weight",
        }
    else:
        names = {
            "text": "condition_embedder.text_embedder.linear_1.weight",
            "time": "condition_embedder.time_embedder.linear_1.weight",
            "ffn": "blocks.0.ffn.net.0.proj.weight",
            "out": "proj_out.weight",
        }
    block_re = re.compile(r"^blocks\.(\d+)\.")  # the same in both layouts
    required = ["patch_embedding.weight", *names.values()]
    missing = [k for k in required if k not in stripped]
    if missing:
        raise ModelFileError(
            f"{src.path}: incomplete Wan DiT, missing {', '.join(missing)} (found {len(stripped)} tensors: "
            f"{_first_keys(sorted(stripped))})."
        )
    pe = stripped["patch_embedding.weight"]
    if len(pe) != 5:
        raise ModelFileError(f"{src.path}: patch_embedding.weight has shape {list(pe)}, expected a 5-D Conv3d weight.")
    dim, in_ch, patch = pe[0], pe[1], pe[2:]
    layers = 1 + max(int(m.group(1)) for k in stripped if (m := block_re.match(k)))
    out_ch = stripped[names["out"]][0] // math.prod(patch)
    heads_meta = src.metadata.get(META_NUM_HEADS)
    if heads_meta is not None:
        heads = int(heads_meta)
    elif dim % HEAD_DIM == 0:
        heads = dim // HEAD_DIM
    else:
        raise ModelFileError(
            f"{src.path}: inner dim {dim} is not a multiple of {HEAD_DIM} and the file does not say its head count "
            f"(metadata {META_NUM_HEADS!r}); cannot infer the attention heads."
        )
    if dim % heads:
        raise ModelFileError(f"{src.path}: inner dim {dim} is not divisible by {heads} heads.")
    return _make_config(
        heads, dim // heads, in_ch, out_ch, stripped[names["text"]][1], stripped[names["time"]][1],
        stripped[names["ffn"]][0], layers, patch,
    )


def _size_label(cfg: dict[str, Any]) -> str:
    for size in ("1.3B", "14B"):
        ref = config_for_size(size)
        if all(cfg.get(k) == ref[k] for k in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")):
            return size
    return f"custom: dim {cfg['num_attention_heads'] * cfg['attention_head_dim']}, {cfg['num_layers']} layers"


def _inspect(src: _Source) -> tuple[DiTCheckpointInfo, dict[str, str]]:
    layout, prefix = _detect_layout(src)
    raw_to_key = _strip(src, prefix)
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
        if raw.endswith(("scale_weight", "scale_input")):
            continue
        num_params += n
        by_dtype[str(dt).replace("torch.", "") if dt is not None else "unknown"] += n
        fp8 = fp8 or dt in FP8_DTYPES
    info = DiTCheckpointInfo(
        path=str(src.path),
        format=src.format,
        key_layout=layout,
        prefix=prefix,
        pt_key=src.pt_key,
        config=cfg,
        size_label=_size_label(cfg),
        num_params=num_params,
        dtype=by_dtype.most_common(1)[0][0] if by_dtype else "unknown",
        fp8=fp8,
        scaled_fp8=_is_scaled_fp8(list(src.shapes)),
        num_tensors=len(src.shapes),
        files=[str(f) for f in src.files],
    )
    return info, raw_to_key


def inspect_dit_checkpoint(path: str | os.PathLike) -> DiTCheckpointInfo:
    """Describe a DiT checkpoint without loading its tensors (safetensors: header only; pickles: mmapped)."""
    info, _ = _inspect(_open_source(path))
    return info


# ----------------------------------------------------------------------------------------------------------
# loading


def _read_converted(
    src: _Source, info: DiTCheckpointInfo, raw_to_key: dict[str, str], device: torch.device
) -> dict[str, torch.Tensor]:
    if info.scaled_fp8:
        raise ModelFileError(
            f"{src.path}: a 'scaled fp8' checkpoint (it has scale_weight/scaled_fp8 entries). SDVG cannot load these "
            "DiTs: use a bf16/fp16 file or a plain fp8_e4m3fn file (no '_scaled' in the name) of the same model."
        )
    raw = src.read(list(raw_to_key), device)
    sd = {raw_to_key[k]: v for k, v in raw.items()}
    if info.key_layout == "original":
        sd = original_to_diffusers(sd)
    return sd


def read_dit_state_dict(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], DiTCheckpointInfo]:
    """The DiT tensors of ``path`` with diffusers key names (prefix stripped, converted), plus the file's info.
    Tensors keep the stored dtype; safetensors are read straight onto ``device``, pickles stay mmapped on CPU."""
    src = _open_source(path)
    info, raw_to_key = _inspect(src)
    return _read_converted(src, info, raw_to_key, torch.device(device)), info


def _target_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Per-parameter dtype: ``dtype``, except modules the model class keeps in fp32 (``_keep_in_fp32_modules``,
    as diffusers does) when loading in half precision."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        fp32 = dtype in (torch.float16, torch.bfloat16) and any(m in parts for m in keep)
        out[name] = torch.float32 if fp32 else dtype
    return out


def _check_keys(model: nn.Module, state_dict: dict[str, torch.Tensor], config: dict[str, Any], name: str) -> None:
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {_first_keys([diffusers_to_original_key(k) for k in missing], 4)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {_first_keys(unexpected, 4)})")
    raise ModelFileError(
        f"{name}: the weights do not match a Wan 2.1 T2V DiT with dim "
        f"{config['num_attention_heads'] * config['attention_head_dim']} and {config['num_layers']} layers: "
        f"{'; '.join(parts)}. The file is incomplete or a different model variant."
    )


def build_dit_from_state_dict(
    state_dict: dict[str, torch.Tensor],
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
    fp8 size."""
    model = _empty_model(config)
    dev = torch.device(device)
    _check_keys(model, state_dict, config, name)
    if fp8_storage:
        dtype = dtype or torch.bfloat16
        for pname, want in _target_dtypes(model, dtype).items():  # meta: free
            mod_name, _, attr = pname.rpartition(".")
            mod = model.get_submodule(mod_name)
            setattr(mod, attr, nn.Parameter(getattr(mod, attr).to(want), requires_grad=False))
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
        targets = {k: p.dtype for k, p in model.named_parameters()}
    else:
        targets = _target_dtypes(model, dtype) if dtype is not None else {}
    ready = {}
    for k in list(state_dict):
        v = state_dict[k]
        want = targets.get(k, v.dtype) if v.is_floating_point() else v.dtype
        ready[k] = v.to(dtype=want) if v.device.type == "meta" or dev.type == "meta" else v.to(device=dev, dtype=want)
    try:
        model.load_state_dict(ready, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{name}: the tensor shapes do not match the inferred config ({exc}).") from exc
    if dev.type != "meta":
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return model


def _resolve_dtype(dtype: str | torch.dtype | None, info: DiTCheckpointInfo, device: torch.device):
    """→ (param/compute dtype, fp8_storage flag)."""
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
    path: str | os.PathLike, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> CausalWanTransformer:
    """Load a Wan 2.1 T2V DiT from any accepted format into ``CausalWanTransformer`` (eval mode, no grad).

    dtype: ``auto`` (bf16/fp16 files keep their dtype on CUDA, fp8 files get fp8 storage; fp32 on CPU), ``bf16``,
    ``fp16``, ``fp32``, or ``fp8_e4m3fn`` = fp8 weight storage with bf16 compute (diffusers layerwise casting).
    Modules listed in the model class's ``_keep_in_fp32_modules`` stay fp32 in bf16/fp16, as in diffusers.
    """
    dev = resolve_device(device, what="DiT")
    src = _open_source(path)
    info, raw_to_key = _inspect(src)
    if info.config["in_channels"] != 16 or info.config["out_channels"] != 16:
        raise ModelFileError(
            f"{path}: a DiT with {info.config['in_channels']} input / {info.config['out_channels']} output channels; "
            "SDVG needs a Wan 2.1 T2V model on the 16-channel Wan 2.1 VAE latent space."
        )
    param_dtype, fp8 = _resolve_dtype(dtype, info, dev)
    # read straight onto the device only when nothing needs converting; otherwise stay on (mmapped) CPU and
    # convert tensor by tensor while moving, so the device never holds two copies
    direct = not fp8 and not info.fp8 and info.dtype == str(param_dtype).replace("torch.", "")
    sd = _read_converted(src, info, raw_to_key, dev if direct else torch.device("cpu"))
    model = build_dit_from_state_dict(sd, info.config, dtype=param_dtype, device=dev, fp8_storage=fp8, name=str(path))
    del sd
    logger.info("loaded %s as %s on %s", info.summary(), FP8_STORAGE if fp8 else param_dtype, dev)
    return model


# ----------------------------------------------------------------------------------------------------------
# tiny models for tests and demos

TINY_TEXT_DIM = 64  # d_model of the tiny UMT5 written by text_encoder.write_tiny_text_encoder
# drafter: dim 64 (2 heads of 32), 2 layers, ffn 256; target: dim 256 (4 heads of 64), 4 layers, ffn 1024.
# One CausalWanTransformer.forward_block at the demo size (8x12 latents, a 3-frame block attending to 3 cached
# context frames, cross-attention K/V from the prompt cache), fp32 on 2 CPU threads: drafter ~2.4-2.9 ms, target
# ~37-60 ms (best of 30: 16-21x; medians on a busy machine 8-9.5x).
TINY_DRAFTER_CONFIG = _make_config(2, 32, 16, 16, TINY_TEXT_DIM, 64, 256, 2, (1, 2, 2))
TINY_TARGET_CONFIG = _make_config(8, 64, 16, 16, TINY_TEXT_DIM, 64, 2048, 4, (1, 2, 2))


def random_original_state_dict(config: dict[str, Any], *, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Deterministic random weights in the original Wan key layout (fp32), scaled like a real init: normal(0, std)
    matrices, zero biases, unit norm weights, small modulation tables."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in sorted(original_key_shapes(config).items()):
        if key.endswith("modulation"):
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif ".norm" in key and key.endswith(".weight"):
            t = torch.ones(shape)
        elif key.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * std * 0.1
        else:
            t = torch.randn(shape, generator=gen) * std
        out[key] = t.contiguous()
    return out


def write_tiny_dits(models_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the tiny drafter (``.pt`` like self_forcing_dmd.pt) and target (``.safetensors`` like Krea's file) into
    ``models_dir/diffusion_models/``; deterministic. Returns {"drafter": path, "target": path}."""
    from safetensors.torch import save_file

    folder = Path(models_dir) / "diffusion_models"
    folder.mkdir(parents=True, exist_ok=True)
    drafter = folder / "sdvg_tiny_drafter.pt"
    target = folder / "sdvg_tiny_target.safetensors"

    sd = random_original_state_dict(TINY_DRAFTER_CONFIG, seed=1234)
    ema = random_original_state_dict(TINY_DRAFTER_CONFIG, seed=1235)
    # the EMA shadow is a blend of the generator and another draw, so the two entries differ (like a real EMA)
    ema = {k: (0.9 * sd[k] + 0.1 * ema[k]).contiguous() for k in sd}
    torch.save(
        {
            "generator": {"model." + k: v for k, v in sd.items()},
            "generator_ema": {"model." + k: v for k, v in ema.items()},
            "config": {"num_heads": TINY_DRAFTER_CONFIG["num_attention_heads"]},
        },
        str(drafter),
    )
    tsd = random_original_state_dict(TINY_TARGET_CONFIG, seed=4321)
    save_file(
        {"model." + k: v.to(torch.bfloat16).contiguous() for k, v in tsd.items()},
        str(target),
        metadata={META_NUM_HEADS: str(TINY_TARGET_CONFIG["num_attention_heads"])},  # one entry: stable header
    )
    return {"drafter": drafter, "target": target}
