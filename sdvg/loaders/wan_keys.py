"""Wan 2.1 T2V DiT key layouts and configs: what the tensor names and shapes of a checkpoint mean.

* names: the original Wan layout (``blocks.N.self_attn.q``, ``head.modulation``; Self-Forcing, Krea, Comfy-Org) and
  the diffusers layout (``blocks.N.attn1.to_q``, ``scale_shift_table``), converted with diffusers' own converter one
  way and with our reverse rename map the other;
* configs: the constructor arguments of the released 1.3B / 14B models, and of any DiT inferred from its shapes.

Pure functions of names and shapes: no file is read here (``wan_loading`` reads files).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..blocks import ROPE_POSITIONS
from ..errors import ModelFileError
from .checkpoint import describe_keys

logger = logging.getLogger(__name__)

HEAD_DIM = 128  # real Wan 2.1 DiTs (1.3B and 14B) both use 128-wide attention heads
META_NUM_HEADS = "sdvg.num_heads"  # safetensors metadata / .pt "config" entry for files whose head_dim is not 128

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
FIXED_CONFIG = {
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": ROPE_POSITIONS,
    "pos_embed_seq_len": None,
}
CONFIG_KEYS = (
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    *FIXED_CONFIG,
)
# the tensors the config is read from, in each layout
_SHAPE_KEYS = {
    "original": {
        "text": "text_embedding.0.weight",
        "time": "time_embedding.0.weight",
        "ffn": "blocks.0.ffn.0.weight",
        "out": "head.head.weight",
    },
    "diffusers": {
        "text": "condition_embedder.text_embedder.linear_1.weight",
        "time": "condition_embedder.time_embedder.linear_1.weight",
        "ffn": "blocks.0.ffn.net.0.proj.weight",
        "out": "proj_out.weight",
    },
}
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.")  # the same in both layouts


def to_original_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-keyed DiT state dict under the original Wan 2.1 names (fp32, detached): what the exports write."""
    return {diffusers_to_original_key(k): v.detach().float().contiguous() for k, v in state_dict.items()}


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


def original_to_diffusers_names(keys: Iterable[str]) -> dict[str, str]:
    """The diffusers name of each original Wan key, without reading a tensor: diffusers' own converter run on the
    names (for T2V checkpoints it only renames; a key it would split or reshape is refused)."""
    keys = list(keys)
    converted = original_to_diffusers({k: k for k in keys})
    names = {old: new for new, old in converted.items() if isinstance(old, str)}
    if len(names) != len(keys) or len(converted) != len(keys):
        raise ModelFileError("This Wan checkpoint needs more than renaming to load (keys diffusers splits or merges); "
                             "SDVG loads Wan 2.1 T2V DiTs only.")
    return names


def make_config(heads, head_dim, in_ch, out_ch, text_dim, freq_dim, ffn, layers, patch) -> dict[str, Any]:
    """A ``CausalWanTransformer`` constructor config from the numbers that differ between Wan DiTs."""
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
    cfg.update(FIXED_CONFIG)
    return cfg


def config_for_size(size: str) -> dict[str, Any]:
    """The constructor config of the released 1.3B / 14B Wan 2.1 T2V DiTs."""
    dims = {"1.3B": (12, 8960, 30), "14B": (40, 13824, 40)}
    if size not in dims:
        raise ValueError(f"unknown Wan 2.1 size {size!r}; use '1.3B' or '14B'")
    heads, ffn, layers = dims[size]
    return make_config(heads, HEAD_DIM, 16, 16, 4096, 256, ffn, layers, (1, 2, 2))


def size_label(cfg: dict[str, Any]) -> str:
    """'1.3B' / '14B' for the released shapes, else 'custom: dim D, L layers'."""
    for size in ("1.3B", "14B"):
        ref = config_for_size(size)
        if all(cfg.get(k) == ref[k] for k in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")):
            return size
    return f"custom: dim {cfg['num_attention_heads'] * cfg['attention_head_dim']}, {cfg['num_layers']} layers"


def original_key_shapes(config: dict[str, Any]) -> dict[str, list[int]]:
    """Exact original-format key → shape of a DiT with ``config``, derived from the diffusers module tree on the
    meta device and our reverse rename map (no memory is used)."""
    from ..models.dit import CausalWanTransformer  # diffusers: only when shapes are asked for

    with torch.device("meta"):
        model = CausalWanTransformer(**config)
    return {diffusers_to_original_key(k): list(v.shape) for k, v in model.state_dict().items()}


def config_from_diffusers(dcfg: dict[str, Any]) -> dict[str, Any]:
    """The constructor config from a diffusers ``config.json`` (unknown entries dropped)."""
    cfg = dict(FIXED_CONFIG)
    cfg.update({k: v for k, v in dcfg.items() if k in CONFIG_KEYS})
    if "patch_size" in cfg:
        cfg["patch_size"] = tuple(cfg["patch_size"])
    return cfg


def _heads(dim: int, heads_hint: Any, name: str) -> int:
    if heads_hint is not None:
        heads = int(heads_hint)
    elif dim % HEAD_DIM == 0:
        heads = dim // HEAD_DIM
    else:
        raise ModelFileError(
            f"{name}: inner dim {dim} is not a multiple of {HEAD_DIM} and the file does not say its head count "
            f"(metadata {META_NUM_HEADS!r}); cannot infer the attention heads."
        )
    if dim % heads:
        raise ModelFileError(f"{name}: inner dim {dim} is not divisible by {heads} heads.")
    return heads


def config_from_shapes(
    stripped: dict[str, tuple[int, ...]], layout: str, *, heads_hint: Any = None, name: str = "checkpoint"
) -> dict[str, Any]:
    """The constructor config of a DiT from its (prefix-free) key → shape map in ``layout`` ("original" or
    "diffusers"). The head count is not in the shapes: ``heads_hint`` or ``dim // 128``."""
    names = _SHAPE_KEYS[layout]
    missing = [k for k in ("patch_embedding.weight", *names.values()) if k not in stripped]
    if missing:
        raise ModelFileError(
            f"{name}: incomplete Wan DiT, missing {', '.join(missing)} (found {describe_keys(stripped)})."
        )
    pe = stripped["patch_embedding.weight"]
    if len(pe) != 5:
        raise ModelFileError(f"{name}: patch_embedding.weight has shape {list(pe)}, expected a 5-D Conv3d weight.")
    dim, in_ch, patch = pe[0], pe[1], pe[2:]
    layers = 1 + max(int(m.group(1)) for k in stripped if (m := _BLOCK_RE.match(k)))
    out_ch = stripped[names["out"]][0] // math.prod(patch)
    heads = _heads(dim, heads_hint, name)
    return make_config(
        heads, dim // heads, in_ch, out_ch, stripped[names["text"]][1], stripped[names["time"]][1],
        stripped[names["ffn"]][0], layers, patch,
    )
