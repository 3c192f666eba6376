"""UMT5-XXL text encoder files → :class:`~sdvg.models.TextEncoder` (weights, config from shapes, a local tokenizer).

Accepted files:

* Comfy-Org ``umt5_xxl_*.safetensors``: Hugging Face key names (``encoder.block.N.layer.0.SelfAttention.q.weight``,
  ``shared.weight``) and the sentencepiece tokenizer inside as the ``spiece_model`` uint8 tensor. The fp8 "scaled"
  variant (``scale_weight`` keys) is dequantized on load (weight · scale), plain fp8 is upcast;
* Wan-AI ``models_t5_umt5-xxl-enc-bf16.pth`` (or ``.safetensors``) with the original Wan T5 names
  (``token_embedding.weight``, ``blocks.N.attn.q.weight`` …); the tokenizer (``spiece.model`` or ``tokenizer.json``)
  must sit beside it, in ``google/umt5-xxl/``, ``umt5-xxl/`` or ``tokenizer/`` there, or be passed explicitly;
* a Hugging Face folder (``config.json`` + ``model*.safetensors``/``pytorch_model*.bin`` + tokenizer files).

Nothing is ever downloaded: the tokenizer comes from the file or from beside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..devices import FP8_STORAGE, default_compute_dtype, parse_dtype, resolve_device
from ..errors import ConfigError, ModelFileError
from ..models.text_encoder import LocalTokenizer, TextEncoder
from .checkpoint import describe_keys, load_checkpoint, looks_like, parameters_on_meta, prefix_before, strip_prefix
from .file_checks import require_path
from .scaled_fp8 import FP8_DTYPES, split_scales

logger = logging.getLogger(__name__)

__all__ = ["load_text_encoder", "read_tokenizer", "wan_t5_to_hf", "hf_to_wan_t5"]

SPIECE_KEY = "spiece_model"
META_MAX_DISTANCE = "sdvg.relative_attention_max_distance"
TOKENIZER_FILES = ("spiece.model", "tokenizer.json")
TOKENIZER_SUBDIRS = ("", "google/umt5-xxl", "umt5-xxl", "umt5_xxl", "tokenizer")
HF_ANCHOR = "encoder.block.0.layer.0.SelfAttention.q.weight"
WAN_ANCHOR = "blocks.0.attn.q.weight"

# (original Wan T5 name, Hugging Face UMT5 name); "{i}" is the block index
_WAN_BLOCK_KEYS = (
    ("blocks.{i}.norm1.weight", "encoder.block.{i}.layer.0.layer_norm.weight"),
    ("blocks.{i}.attn.q.weight", "encoder.block.{i}.layer.0.SelfAttention.q.weight"),
    ("blocks.{i}.attn.k.weight", "encoder.block.{i}.layer.0.SelfAttention.k.weight"),
    ("blocks.{i}.attn.v.weight", "encoder.block.{i}.layer.0.SelfAttention.v.weight"),
    ("blocks.{i}.attn.o.weight", "encoder.block.{i}.layer.0.SelfAttention.o.weight"),
    ("blocks.{i}.pos_embedding.embedding.weight", "encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"),
    ("blocks.{i}.norm2.weight", "encoder.block.{i}.layer.1.layer_norm.weight"),
    ("blocks.{i}.ffn.gate.0.weight", "encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight"),
    ("blocks.{i}.ffn.fc1.weight", "encoder.block.{i}.layer.1.DenseReluDense.wi_1.weight"),
    ("blocks.{i}.ffn.fc2.weight", "encoder.block.{i}.layer.1.DenseReluDense.wo.weight"),
)
_WAN_TOP_KEYS = (("token_embedding.weight", "shared.weight"), ("norm.weight", "encoder.final_layer_norm.weight"))



def read_tokenizer(path: Path) -> LocalTokenizer:
    """A ``spiece.model`` or ``tokenizer.json`` file as the encoder's tokenizer."""
    if path.name.endswith(".json"):
        return LocalTokenizer(tokenizer_json=path.read_text(encoding="utf-8"), source=str(path))
    return LocalTokenizer(spiece=path.read_bytes(), source=str(path))


def _find_tokenizer(folder: Path) -> Path | None:
    for sub in TOKENIZER_SUBDIRS:
        for name in TOKENIZER_FILES:
            cand = folder / sub / name if sub else folder / name
            if cand.is_file():
                return cand
    return None


# ----------------------------------------------------------------------------------------------------------
# weights


def wan_t5_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan T5 encoder keys → Hugging Face ``UMT5EncoderModel`` keys (unknown keys are kept as they are,
    so a strict load reports them)."""
    table = dict(_WAN_TOP_KEYS)
    for i in _block_indices(sd, r"^blocks\.(\d+)\."):
        table.update({w.format(i=i): h.format(i=i) for w, h in _WAN_BLOCK_KEYS})
    return {table.get(k, k): v for k, v in sd.items()}


def hf_to_wan_t5(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``wan_t5_to_hf`` (``encoder.embed_tokens.weight`` is dropped: it is tied to ``shared``)."""
    table = {h: w for w, h in _WAN_TOP_KEYS}
    for i in _block_indices(sd, r"^encoder\.block\.(\d+)\."):
        table.update({h.format(i=i): w.format(i=i) for w, h in _WAN_BLOCK_KEYS})
    return {table.get(k, k): v for k, v in sd.items() if k != "encoder.embed_tokens.weight"}


def _block_indices(sd: dict[str, Any], pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in sd if (m := rx.match(k))})


def _dequantize(sd: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Comfy scaled fp8, either layout (``scale_weight`` or ``weight_scale``): ``W = W_fp8 · scale``; plain fp8 is
    upcast. Marker and input-scale entries are dropped."""
    kept, scales = split_scales(sd)
    out: dict[str, torch.Tensor] = {}
    for k, v in kept.items():
        if v.dtype in FP8_DTYPES:
            v = v.to(torch.float32)
            scale = scales.get(k)
            if scale is not None:
                scale = scale.to(torch.float32)
                if scale.numel() != 1 and scale.ndim != v.ndim:
                    raise ModelFileError(f"{name}: unsupported fp8 scale of shape {list(scale.shape)} for {k}.")
                v = v * scale
        out[k] = v
    return out


def _config_from_shapes(sd: dict[str, torch.Tensor], meta: dict[str, Any], name: str):
    from transformers import UMT5Config

    required = ("shared.weight", HF_ANCHOR, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                "encoder.block.0.layer.1.DenseReluDense.wi_0.weight")
    missing = [k for k in required if k not in sd]
    if missing:
        raise ModelFileError(f"{name}: incomplete UMT5 encoder, missing {', '.join(missing)}.")
    vocab, d_model = sd["shared.weight"].shape
    buckets, heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape
    inner = sd[HF_ANCHOR].shape[0]
    return UMT5Config(
        vocab_size=int(vocab), d_model=int(d_model), d_kv=int(inner // heads), num_heads=int(heads),
        d_ff=int(sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0]),
        num_layers=len(_block_indices(sd, r"^encoder\.block\.(\d+)\.")),
        relative_attention_num_buckets=int(buckets),
        relative_attention_max_distance=int(meta.get(META_MAX_DISTANCE, 128)),
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
    )


def _describe(keys: list[str]) -> str:
    return f"found {describe_keys(keys)}, looks like {looks_like(keys)}"


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ck = load_checkpoint(path)
    return ck.tensors, dict(ck.metadata)


def _strip_prefix(sd: dict[str, torch.Tensor], anchor: str) -> dict[str, torch.Tensor] | None:
    prefix = prefix_before(sd, anchor)
    return None if prefix is None else strip_prefix(sd, prefix)


def load_text_encoder(
path: str | os.PathLike, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
tokenizer: str | os.PathLike | None = None, cache_size: int = 8,
) -> TextEncoder:
    """Load from a Comfy-Org ``umt5_xxl_*.safetensors``, a Wan ``models_t5_umt5-xxl-enc-bf16.pth`` or a Hugging
    Face folder. ``tokenizer`` (a ``spiece.model``/``tokenizer.json`` file or a folder holding one) overrides
    the tokenizer found with the weights. Nothing is ever downloaded."""
    p = Path(path).expanduser()
    require_path(p, f"Text encoder not found: {p}. Put umt5_xxl_*.safetensors into models/text_encoders/ or "
                    "fix the path.")
    dev = resolve_device(device, what="text encoder")
    want = parse_dtype(dtype, default=default_compute_dtype(dev))
    if want == FP8_STORAGE:
        raise ConfigError("fp8 storage is not supported for the text encoder; use bf16 (or fp32 on CPU).")
    if want == torch.float16:
        logger.warning("UMT5 is known to overflow in fp16; prefer bf16 or fp32 for the text encoder")
    sd, meta, tok, config = _load_any(p)
    if tokenizer is not None:
        tok = _tokenizer_from_arg(Path(tokenizer).expanduser())
    if tok is None:
        here = p if p.is_dir() else p.parent
        raise ModelFileError(
            f"{p}: no tokenizer. This text encoder file does not contain one, and no spiece.model or tokenizer.json "
            f"was found in {here} (also looked in {', '.join(s for s in TOKENIZER_SUBDIRS if s)}). Put the "
            "google/umt5-xxl tokenizer files (spiece.model or tokenizer.json) beside the file, or use Comfy-Org's "
            "umt5_xxl_*.safetensors which has the tokenizer inside."
        )
    if config is None:
        config = _config_from_shapes(sd, meta, str(p))
    model = _build(config, sd, want, dev, str(p))
    logger.info("loaded UMT5 encoder %s (d_model %d, %d layers, vocab %d) as %s on %s", p, config.d_model,
                config.num_layers, config.vocab_size, want, dev)
    return TextEncoder(model, tok, name=str(p), cache_size=cache_size)


def _tokenizer_from_arg(t: Path) -> LocalTokenizer:
    if t.is_dir():
        found = _find_tokenizer(t)
        if found is None:
            raise ModelFileError(f"{t}: no spiece.model or tokenizer.json in this tokenizer folder.")
        t = found
    require_path(t, f"Tokenizer not found: {t}. Pass a spiece.model or tokenizer.json file, or a folder holding one.")
    return read_tokenizer(t)


def _load_any(p: Path):
    """→ (HF-keyed state dict, metadata, tokenizer or None, UMT5Config or None)."""
    config = None
    if p.is_dir():
        sd, meta, config = _read_hf_folder(p)
        found = _find_tokenizer(p)
        return sd, meta, read_tokenizer(found) if found else None, config
    raw, meta = _read_weights(p)
    tok = None
    if SPIECE_KEY in raw:
        tok = LocalTokenizer(spiece=raw.pop(SPIECE_KEY).numpy().tobytes(), source=f"{p} [{SPIECE_KEY}]")
    sd = _strip_prefix(raw, HF_ANCHOR)
    if sd is None:
        wan = _strip_prefix(raw, WAN_ANCHOR)
        if wan is None or not any(k.endswith("token_embedding.weight") for k in wan):
            raise ModelFileError(f"{p}: not a UMT5 text encoder: {_describe(list(raw))}. Pick umt5_xxl_*.safetensors "
                                 "or models_t5_umt5-xxl-enc-bf16.pth.")
        sd = wan_t5_to_hf(wan)
    if tok is None:
        found = _find_tokenizer(p.parent)
        tok = read_tokenizer(found) if found else None
    return _dequantize(sd, str(p)), meta, tok, config


def _read_hf_folder(folder: Path):
    from transformers import UMT5Config

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        found = ", ".join(sorted(x.name for x in folder.iterdir())[:12])
        raise ModelFileError(f"{folder}: a folder without config.json (found: {found or 'nothing'}). A Hugging Face "
                             "text encoder folder needs config.json, the weights and the tokenizer files.")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{cfg_file}: not readable JSON ({exc}).") from exc
    cfg.update(is_encoder_decoder=False, use_cache=False)
    config = UMT5Config(**{k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"})
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelFileError(f"{folder}: no model*.safetensors or pytorch_model*.bin weights in this folder.")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read_weights(f)[0])
    sd = {k: v for k, v in sd.items() if not k.startswith(("decoder.", "lm_head."))}
    return _dequantize(sd, str(folder)), {}, config


def _build(config, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, name: str):
    from transformers import UMT5EncoderModel

    sd = dict(sd)
    sd.setdefault("encoder.embed_tokens.weight", sd.get("shared.weight"))
    sd.setdefault("shared.weight", sd.get("encoder.embed_tokens.weight"))
    with parameters_on_meta():
        model = UMT5EncoderModel(config)
    expected = set(model.state_dict())
    missing = sorted(expected - {k for k, v in sd.items() if v is not None})
    unexpected = sorted(set(sd) - expected)
    if missing or unexpected:
        raise ModelFileError(
            f"{name}: the weights do not match a UMT5 encoder with d_model {config.d_model} and {config.num_layers} "
            f"layers: missing {missing[:4]}{' …' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
            f"{' …' if len(unexpected) > 4 else ''}."
        )
    ready = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in sd.items()}
    try:
        model.load_state_dict(ready, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{name}: tensor shapes do not match the inferred UMT5 config ({exc}).") from exc
    model.encoder.embed_tokens = model.shared
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
