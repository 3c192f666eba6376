"""Wan 2.1 VAE files → diffusers ``AutoencoderKLWan``: key layouts, config from shapes, file reading.

Accepted: the original Wan key layout (Comfy-Org ``wan_2.1_vae.safetensors``, Wan-AI ``Wan2.1_VAE.pth``), a
diffusers folder (also a pipeline root holding ``vae/``) or a diffusers-keyed file. The architecture is inferred from
tensor shapes, so the tiny test VAE loads through the same path as the real one. The streaming decoder built on the
result lives in ``models/vae.py``; :func:`load_streaming_vae` wraps a file in it.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

from ..devices import default_compute_dtype, parse_dtype, resolve_device
from ..errors import ConfigError, ModelFileError
from ..models.vae import StreamingVAE
from .checkpoint import (
    Checkpoint,
    common_prefix,
    describe_checkpoint,
    describe_keys,
    load_checkpoint,
    looks_like,
    strip_prefix,
)
from .file_checks import broken_link

logger = logging.getLogger(__name__)

__all__ = ["load_streaming_vae", "load_wan_vae", "build_vae_model", "read_vae_state_dict", "infer_vae_config", "wan_vae_to_original_keys"]

VAE_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
META_CONFIG = "sdvg_config"  # safetensors metadata entry: the AutoencoderKLWan config as JSON (tiny test VAE)
ORIGINAL_ANCHOR = "decoder.middle.0.residual.0.gamma"
DIFFUSERS_ANCHOR = "decoder.mid_block.resnets.0.norm1.gamma"
_STRIP_PREFIXES = ("first_stage_model.", "vae.", "model.")
_PICK = "Pick wan_2.1_vae.safetensors (Comfy-Org) or Wan2.1_VAE.pth (Wan-AI)."


# ----------------------------------------------------------------------------------------------------------
# key layouts

_RES_INV = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
            "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _res_inv(rest: str) -> str:
    for new, old in _RES_INV.items():
        if rest == new or rest.startswith(new + "."):
            return old + rest[len(new):]
    raise KeyError(rest)


def wan_vae_to_original_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of diffusers' ``convert_wan_vae_to_diffusers`` for the Wan 2.1 layout (num_res_blocks = 2).

    Tensors are passed through by reference. Raises ``ConfigError`` on a key it cannot map.
    """
    out: dict[str, torch.Tensor] = {}
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    for key, value in sd.items():
        try:
            new = _original_key(key, top)
        except KeyError as exc:
            raise ConfigError(f"Cannot map diffusers Wan VAE key {key!r} to the original layout.") from exc
        out[new] = value
    return out


# diffusers name (after "encoder." / "decoder.") → original name: (only for this half or None, pattern, builder)
_KEY_RULES = tuple((only, re.compile(pattern), build) for only, pattern, build in (
    (None, r"conv_in\.(.+)", lambda h, m: f"{h}.conv1.{m[1]}"),
    (None, r"norm_out\.(.+)", lambda h, m: f"{h}.head.0.{m[1]}"),
    (None, r"conv_out\.(.+)", lambda h, m: f"{h}.head.2.{m[1]}"),
    (None, r"mid_block\.resnets\.(\d+)\.(.+)", lambda h, m: f"{h}.middle.{2 * int(m[1])}.{_res_inv(m[2])}"),
    (None, r"mid_block\.attentions\.0\.(.+)", lambda h, m: f"{h}.middle.1.{m[1]}"),
    ("encoder", r"down_blocks\.(\d+)\.((?:resample|time_conv)\..+)", lambda h, m: f"encoder.downsamples.{m[1]}.{m[2]}"),
    ("encoder", r"down_blocks\.(\d+)\.(.+)", lambda h, m: f"encoder.downsamples.{m[1]}.{_res_inv(m[2])}"),
    ("decoder", r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)",
     lambda h, m: f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_res_inv(m[3])}"),
    ("decoder", r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", lambda h, m: f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"),
))


def _original_key(key: str, top: dict[str, str]) -> str:
    head, _, rest = key.partition(".")
    if head in top:
        return f"{top[head]}.{rest}"
    if head in ("encoder", "decoder"):
        for only, pattern, build in _KEY_RULES:
            if only in (None, head) and (m := pattern.fullmatch(rest)):
                return build(head, m)
    raise KeyError(key)


# ----------------------------------------------------------------------------------------------------------
# config from shapes


def _is_wan22(sd: dict[str, Any], cfg_hint: dict | None = None) -> bool:
    if cfg_hint and (cfg_hint.get("z_dim") == 48 or cfg_hint.get("is_residual")):
        return True
    if any(".upsamples.0.upsamples." in k or "avg_shortcut" in k or ".resnets.0.resnets." in k
           or re.search(r"down_blocks\.\d+\.resnets\.", k) for k in sd):
        return True
    for key in ("conv2.weight", "post_quant_conv.weight"):
        t = sd.get(key)
        if torch.is_tensor(t) and t.ndim >= 1 and t.shape[0] == 48:
            return True
    return False


def _encoder_stages(sd: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[bool]]:
    """Per stage the widths of its res blocks, and per downsample whether it is temporal (raises KeyError)."""
    entries: dict[int, tuple[str, int, bool]] = {}
    for key, t in sd.items():
        m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(conv1|resample\.1|time_conv)\.weight", key)
        if not m:
            continue
        n, part = int(m.group(1)), m.group(2)
        if part == "conv1":
            entries[n] = ("res", int(t.shape[0]), False)
        elif part == "time_conv":
            entries[n] = ("down", 0, True)
        elif n not in entries:
            entries[n] = ("down", 0, False)
    if not entries or sorted(entries) != list(range(len(entries))):
        raise KeyError("encoder.down_blocks")
    stages: list[list[int]] = [[]]
    temporal: list[bool] = []
    for n in sorted(entries):
        kind, width, is_t = entries[n]
        if kind == "res":
            stages[-1].append(width)
        else:
            temporal.append(is_t)
            stages.append([])
    return stages, temporal


def infer_vae_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Architecture of a diffusers-keyed Wan 2.1 VAE state dict, from tensor shapes only (KeyError when odd)."""
    enc_in = sd["encoder.conv_in.weight"]
    base_dim, in_channels = int(enc_in.shape[0]), int(enc_in.shape[1])
    stages, temporal = _encoder_stages(sd)
    counts = {len(s) for s in stages}
    if len(counts) != 1 or 0 in counts or any(len(set(s)) != 1 for s in stages):
        raise KeyError("encoder stage layout")
    widths = [s[0] for s in stages]
    if any(w % base_dim for w in widths):
        raise KeyError("encoder widths")
    dim_mult = [w // base_dim for w in widths]
    dec_in = int(sd["decoder.conv_in.weight"].shape[0])
    if dec_in % dim_mult[-1]:
        raise KeyError("decoder width")
    decoder_base_dim = dec_in // dim_mult[-1]
    return {
        "base_dim": base_dim,
        "decoder_base_dim": None if decoder_base_dim == base_dim else decoder_base_dim,
        "z_dim": int(sd["post_quant_conv.weight"].shape[0]),
        "dim_mult": dim_mult,
        "num_res_blocks": counts.pop(),
        "temperal_downsample": temporal,
        "in_channels": in_channels,
        "out_channels": int(sd["decoder.conv_out.weight"].shape[0]),
    }


# ----------------------------------------------------------------------------------------------------------
# file reading


def _find_diffusers_dir(path: Path) -> Path:
    for cand in (path, path / "vae"):
        if (cand / "config.json").is_file():
            return cand
    raise ModelFileError(
        f"The VAE folder {path} has no config.json (nor vae/config.json); found: "
        f"{', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'nothing'}. Point to a diffusers "
        "AutoencoderKLWan folder or to a single VAE file."
    )


def _read_diffusers_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    folder = _find_diffusers_dir(path)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"Cannot parse {folder / 'config.json'}: {exc}") from exc
    cls = cfg.get("_class_name")
    if cls and cls != "AutoencoderKLWan":
        raise ModelFileError(
            f"The folder {folder} holds a {cls}, not an AutoencoderKLWan (Wan VAE). Pick the VAE folder."
        )
    weights = [folder / n for n in ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")]
    found = [w for w in weights if w.is_file()]
    if not found:
        raise ModelFileError(
            f"The VAE folder {folder} has config.json but no diffusion_pytorch_model.safetensors "
            "(sharded VAE weights are not supported)."
        )
    return load_checkpoint(found[0]).tensors, cfg


def _metadata_config(ck: Checkpoint) -> dict[str, Any] | None:
    try:
        return json.loads(ck.metadata[META_CONFIG]) if META_CONFIG in ck.metadata else None
    except ValueError:
        return None


def _foreign_error(path: Path, ck: Checkpoint, keys: list[str]) -> ModelFileError:
    kind = looks_like(keys, entry=ck.entry)
    return ModelFileError(
        f"The file {path} is not a Wan 2.1 VAE: "
        + (f"it looks like {kind}. " if kind != "an unknown model" else "")
        + f"Found {describe_checkpoint(ck)}; a Wan VAE has e.g. {ORIGINAL_ANCHOR}. {_PICK}"
    )


def _wan22_error(path: Path) -> ModelFileError:
    return ModelFileError(
        f"The VAE file {path} is a Wan 2.2 VAE (48 latent channels, 16x spatial). The Wan 2.1 models used here "
        "(Self-Forcing, Krea Realtime) need the Wan 2.1 VAE with 16 latent channels: use wan_2.1_vae.safetensors."
    )


def read_vae_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, str]:
    """Read ``path`` → (diffusers-keyed state dict, explicit config or None, format label)."""
    if path.is_dir():
        sd, cfg = _read_diffusers_dir(path)
        return sd, cfg, "diffusers folder"
    ck = load_checkpoint(path)
    fmt = "safetensors" if ck.format == "safetensors" else "torch pickle"
    sd = strip_prefix(ck.tensors, common_prefix(ck.tensors, _STRIP_PREFIXES))
    if ORIGINAL_ANCHOR in sd:
        if _is_wan22(sd):
            raise _wan22_error(path)
        return convert_wan_vae_to_diffusers(sd), _metadata_config(ck), f"{fmt}, original Wan keys"
    if DIFFUSERS_ANCHOR in sd:
        return sd, _metadata_config(ck), f"{fmt}, diffusers keys"
    raise _foreign_error(path, ck, list(sd))


# ----------------------------------------------------------------------------------------------------------
# building


def _config(path: Path, sd: dict[str, torch.Tensor], cfg_hint: dict | None) -> dict[str, Any]:
    try:
        cfg = infer_vae_config(sd)
    except KeyError as exc:
        raise ModelFileError(
            f"The VAE file {path} has Wan VAE keys but an unrecognized layout (missing or odd {exc}); "
            f"found {describe_keys(sd)}. The file may be incomplete."
        ) from exc
    if cfg_hint:  # a diffusers config.json or our metadata: keep the fields the shapes cannot tell
        allowed = set(inspect.signature(AutoencoderKLWan.__init__).parameters) - {"self"}
        for k, v in cfg_hint.items():
            if k in allowed and k not in cfg and k not in ("is_residual", "patch_size"):
                cfg[k] = v
        for k in ("attn_scales", "dropout"):
            if k in cfg_hint:
                cfg[k] = cfg_hint[k]
    if cfg["z_dim"] != 16 or cfg["in_channels"] != 3 or cfg["out_channels"] != 3:
        raise ModelFileError(
            f"The VAE file {path} has z_dim={cfg['z_dim']}, in/out channels {cfg['in_channels']}/"
            f"{cfg['out_channels']}; the Wan 2.1 VAE has 16 latent and 3 pixel channels."
        )
    if cfg["num_res_blocks"] != 2 or len(cfg["dim_mult"]) != 4:
        raise ModelFileError(
            f"The VAE file {path} has num_res_blocks={cfg['num_res_blocks']} and {len(cfg['dim_mult'])} stages; "
            "only the Wan 2.1 layout (2 res blocks, 4 stages) is supported."
        )
    return cfg


def build_vae_model(path: Path, sd: dict[str, torch.Tensor], cfg_hint: dict | None) -> AutoencoderKLWan:
    """``AutoencoderKLWan`` with the diffusers-keyed ``sd`` assigned (strict; no second copy of the weights)."""
    if _is_wan22(sd, cfg_hint):
        raise _wan22_error(path)
    cfg = _config(path, sd, cfg_hint)
    with torch.device("meta"):
        model = AutoencoderKLWan(**cfg)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelFileError(
            f"The VAE file {path} does not match the Wan 2.1 VAE layout inferred from it ({cfg}): "
            f"{str(exc)[:600]}"
        ) from exc
    return model


def _not_found(path: Path) -> ModelFileError:
    link = broken_link(path)
    if link:
        return ModelFileError(link)
    near = ""
    if path.parent.is_dir():
        cands = sorted(p.name for p in path.parent.iterdir() if p.suffix.lower() in VAE_SUFFIXES)
        near = f" Files in {path.parent}: {', '.join(cands[:10]) or 'none'}."
    return ModelFileError(f"VAE file not found: {path}.{near} Put wan_2.1_vae.safetensors into models/vae/.")


def load_wan_vae(path: str | Path, *, device: str | torch.device = "auto",
                 dtype: str | torch.dtype | None = "auto") -> AutoencoderKLWan:
    """A Wan 2.1 VAE from an original-key file (.safetensors/.pth), a diffusers folder or file, on ``device``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise _not_found(path)
    dev = resolve_device(device, what="VAE")
    dt = parse_dtype(dtype, default=default_compute_dtype(dev))
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"The VAE does not support the weight dtype {dtype!r}; use fp32, bf16 or fp16.")
    sd, cfg_hint, fmt = read_vae_state_dict(path)
    # Cast before assigning so the module is built in the user dtype (no fp32 copy of a large VAE).
    sd = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in sd.items()}
    model = build_vae_model(path, sd, cfg_hint).to(device=dev)
    logger.info("Loaded Wan 2.1 VAE from %s (%s) on %s as %s", path, fmt, dev, dt)
    return model


def load_streaming_vae(path: str | Path, *, device: str | torch.device = "auto",
                       dtype: str | torch.dtype | None = "auto") -> StreamingVAE:
    """A Wan 2.1 VAE from an original-key file (.safetensors/.pth), a diffusers folder or file, as the streaming
    decoder (:func:`load_wan_vae`)."""
    return StreamingVAE(load_wan_vae(path, device=device, dtype=dtype), source=str(Path(path).expanduser()))
