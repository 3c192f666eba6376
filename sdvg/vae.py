"""Streaming Wan 2.1 VAE: block-by-block decode with a persistent causal feature cache.

The layers are diffusers' ``AutoencoderKLWan``; this module owns only the streaming glue (SPEC §3):

* ``decode_block`` runs ``post_quant_conv`` and then the decoder one latent frame at a time with a feature
  cache that lives across blocks. ``AutoencoderKLWan.decode()`` clears that cache on entry and exit, so it is
  never called here.
* The decoder *replaces* cache entries (``feat_cache[i] = new_tensor``) and never writes into them, so a
  snapshot is a tuple of references (no tensor copies) and ``restore`` puts those references back.
* ``encode_frame`` encodes one pixel frame as the first frame of a fresh causal encoder stream (used by the
  windowed-recompute regime to re-encode an old frame as context).

Loading accepts the original Wan key layout (Comfy-Org ``wan_2.1_vae.safetensors``, Wan-AI
``Wan2.1_VAE.pth``), a diffusers folder or a diffusers-keyed file. The architecture is inferred from tensor
shapes, so the tiny test VAE written by ``write_tiny_vae`` loads through the same path as the real one.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

from .devices import default_compute_dtype, parse_dtype, resolve_device
from .errors import ConfigError, ModelFileError

logger = logging.getLogger(__name__)

__all__ = [
    "StreamingVAE",
    "VAEState",
    "latent_to_pixel_frames",
    "wan_vae_to_original_keys",
    "write_tiny_vae",
    "TINY_VAE_CONFIG",
    "TINY_VAE_FILENAME",
]

TINY_VAE_FILENAME = "sdvg_tiny_vae.safetensors"
#: Same structure as the real Wan 2.1 VAE (z 16, 8x spatial, 4x temporal, 4 stages, 2 res blocks per stage,
#: temporal downsample in the last two stages) at a tiny width. ``num_res_blocks`` must stay 2: diffusers'
#: original-key conversion of the decoder assumes 3 resnets per up block.
TINY_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 2,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
}
TINY_VAE_SEED = 20240417

_VAE_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
_STRIP_PREFIXES = ("first_stage_model.", "vae.", "model.")


def latent_to_pixel_frames(n_latent: int) -> int:
    """Pixel frames of a causal Wan 2.1 decode of ``n_latent`` latent frames from a fresh stream: 1 + 4(n-1)."""
    n = int(n_latent)
    if n < 0:
        raise ConfigError(f"latent_to_pixel_frames needs a non-negative frame count, got {n_latent}.")
    return 0 if n == 0 else 1 + 4 * (n - 1)


@dataclass(frozen=True)
class VAEState:
    """A snapshot of the streaming decoder: references to the cache entries, never copies.

    Valid because the decoder only ever replaces list entries with new tensors. Restoring it any number of
    times is fine (``restore`` copies the tuple into a fresh list).
    """

    entries: tuple
    frames_decoded: int
    spatial: tuple[int, int] | None
    owner: int

    @property
    def nbytes(self) -> int:
        return _entries_nbytes(self.entries)


def _entries_nbytes(entries) -> int:
    seen: set[int] = set()
    total = 0
    for e in entries:
        if torch.is_tensor(e) and id(e) not in seen:
            seen.add(id(e))
            total += e.numel() * e.element_size()
    return total


# --------------------------------------------------------------------------------------------------------------
# Key layouts
# --------------------------------------------------------------------------------------------------------------

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


def _original_key(key: str, top: dict[str, str]) -> str:
    head, _, rest = key.partition(".")
    if head in top:
        return f"{top[head]}.{rest}"
    if head not in ("encoder", "decoder"):
        raise KeyError(key)
    if rest.startswith("conv_in."):
        return f"{head}.conv1.{rest[len('conv_in.'):]}"
    if rest.startswith("norm_out."):
        return f"{head}.head.0.{rest[len('norm_out.'):]}"
    if rest.startswith("conv_out."):
        return f"{head}.head.2.{rest[len('conv_out.'):]}"
    m = re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", rest)
    if m:
        return f"{head}.middle.{2 * int(m.group(1))}.{_res_inv(m.group(2))}"
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", rest)
    if m:
        return f"{head}.middle.1.{m.group(1)}"
    if head == "encoder":
        m = re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest)
        if m:
            sub = m.group(2)
            if not (sub.startswith("resample.") or sub.startswith("time_conv.")):
                sub = _res_inv(sub)
            return f"encoder.downsamples.{m.group(1)}.{sub}"
    else:
        m = re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)
        if m:
            return f"decoder.upsamples.{4 * int(m.group(1)) + int(m.group(2))}.{_res_inv(m.group(3))}"
        m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest)
        if m:
            return f"decoder.upsamples.{4 * int(m.group(1)) + 3}.{m.group(2)}"
    raise KeyError(key)


def _describe(keys: list[str]) -> str:
    sample = ", ".join(sorted(keys)[:4])
    return f"{len(keys)} tensors (e.g. {sample})"


def _classify_foreign(keys: list[str]) -> str | None:
    """Name what a non-VAE state dict looks like, for the error message."""
    joined = "\n".join(keys[:4000])
    if "head.modulation" in joined or "self_attn." in joined or "patch_embedding" in joined or "attn1.to_q" in joined:
        return "a Wan DiT (diffusion model) checkpoint: put it in diffusion_models/ and pick a VAE file here"
    if "shared.weight" in keys or "encoder.block." in joined or "spiece_model" in keys or "token_embd" in joined:
        return "a text encoder (UMT5/T5) checkpoint, not a VAE"
    if "blip." in joined or "visual_encoder." in joined or "mlp.layers" in joined:
        return "an ImageReward/BLIP checkpoint, not a VAE"
    if any(k.startswith("encoder.down.") or k.startswith("decoder.up.") for k in keys):
        return "an image (SD/Flux-style) VAE, not the Wan 2.1 video VAE"
    return None


def _strip_prefix(sd: dict[str, Any]) -> dict[str, Any]:
    for prefix in _STRIP_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


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


def _infer_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Architecture of a diffusers-keyed Wan 2.1 VAE state dict, from tensor shapes only."""
    enc_in = sd["encoder.conv_in.weight"]
    base_dim, in_channels = int(enc_in.shape[0]), int(enc_in.shape[1])
    z_dim = int(sd["post_quant_conv.weight"].shape[0])
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
        "z_dim": z_dim,
        "dim_mult": dim_mult,
        "num_res_blocks": counts.pop(),
        "temperal_downsample": temporal,
        "in_channels": in_channels,
        "out_channels": int(sd["decoder.conv_out.weight"].shape[0]),
    }


# --------------------------------------------------------------------------------------------------------------
# File reading
# --------------------------------------------------------------------------------------------------------------

def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # SafetensorError, OSError, ...: a corrupt or truncated file
        raise ModelFileError(
            f"Cannot read the VAE file {path}: it is not a valid safetensors file or it is truncated/corrupt "
            f"({type(exc).__name__}: {exc}). Download it again."
        ) from exc
    return sd, meta


def _read_pickle(path: Path) -> dict[str, Any]:
    try:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc).lower():
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        hint = ("it contains objects other than tensors and was refused for safety (weights_only=True)"
                if "weights_only" in str(exc) or "Unpickl" in type(exc).__name__
                else "it is not a PyTorch checkpoint or it is truncated/corrupt")
        raise ModelFileError(
            f"Cannot read the VAE file {path}: {hint} ({type(exc).__name__}: {str(exc)[:300]}). "
            "Use Comfy-Org's wan_2.1_vae.safetensors or Wan-AI's Wan2.1_VAE.pth."
        ) from exc
    if isinstance(obj, dict):
        for wrap in ("state_dict", "model", "module"):
            inner = obj.get(wrap)
            if isinstance(inner, dict) and inner and all(torch.is_tensor(v) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, dict) or not obj:
        raise ModelFileError(f"The VAE file {path} holds a {type(obj).__name__}, not a state dict of tensors.")
    non_tensor = [k for k, v in obj.items() if not torch.is_tensor(v)]
    if non_tensor:
        kind = ("a Self-Forcing/CausVid DiT checkpoint (generator/generator_ema)"
                if "generator_ema" in obj or "generator" in obj else "e.g. a training checkpoint")
        raise ModelFileError(
            f"The file {path} is not a Wan 2.1 VAE: it holds a dict with non-tensor entries "
            f"({', '.join(map(str, non_tensor[:5]))}), {kind}. Pick the VAE file."
        )
    return obj


def _find_diffusers_dir(path: Path) -> Path:
    for cand in (path, path / "vae"):
        if (cand / "config.json").is_file():
            return cand
    raise ModelFileError(
        f"The VAE folder {path} has no config.json (nor vae/config.json); found: "
        f"{', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'nothing'}. Point to a diffusers "
        "AutoencoderKLWan folder or to a single VAE file."
    )


def _load_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, str]:
    """Read ``path`` and return (diffusers-keyed state dict, explicit config or None, format label)."""
    if path.is_dir():
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
        w = found[0]
        sd = _read_safetensors(w)[0] if w.suffix == ".safetensors" else _read_pickle(w)
        return sd, cfg, "diffusers folder"
    if path.suffix.lower() in (".safetensors", ".sft"):
        sd, meta = _read_safetensors(path)
        cfg = None
        if "sdvg_config" in meta:
            try:
                cfg = json.loads(meta["sdvg_config"])
            except ValueError:
                cfg = None
        fmt = "safetensors"
    else:
        sd, cfg, fmt = _read_pickle(path), None, "torch pickle"
    sd = _strip_prefix(sd)
    keys = list(sd)
    if "decoder.middle.0.residual.0.gamma" in sd:
        if _is_wan22(sd):
            raise _wan22_error(path)
        return convert_wan_vae_to_diffusers(sd), cfg, f"{fmt}, original Wan keys"
    if "decoder.mid_block.resnets.0.norm1.gamma" in sd:
        return sd, cfg, f"{fmt}, diffusers keys"
    what = _classify_foreign(keys)
    raise ModelFileError(
        f"The file {path} is not a Wan 2.1 VAE: "
        + (f"it looks like {what}. " if what else "")
        + f"Found {_describe(keys)}; a Wan VAE has e.g. decoder.middle.0.residual.0.gamma. "
        "Pick wan_2.1_vae.safetensors (Comfy-Org) or Wan2.1_VAE.pth (Wan-AI)."
    )


def _wan22_error(path: Path) -> ModelFileError:
    return ModelFileError(
        f"The VAE file {path} is a Wan 2.2 VAE (48 latent channels, 16x spatial). The Wan 2.1 models used here "
        "(Self-Forcing, Krea Realtime) need the Wan 2.1 VAE with 16 latent channels: use wan_2.1_vae.safetensors."
    )


def _build_model(path: Path, sd: dict[str, torch.Tensor], cfg_hint: dict | None) -> AutoencoderKLWan:
    if _is_wan22(sd, cfg_hint):
        raise _wan22_error(path)
    try:
        cfg = _infer_config(sd)
    except KeyError as exc:
        raise ModelFileError(
            f"The VAE file {path} has Wan VAE keys but an unrecognized layout (missing or odd {exc}); "
            f"found {_describe(list(sd))}. The file may be incomplete."
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
    with torch.device("meta"):
        model = AutoencoderKLWan(**cfg)
    try:
        result = model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelFileError(
            f"The VAE file {path} does not match the Wan 2.1 VAE layout inferred from it ({cfg}): "
            f"{str(exc)[:600]}"
        ) from exc
    del result
    return model


# --------------------------------------------------------------------------------------------------------------
# Streaming VAE
# --------------------------------------------------------------------------------------------------------------

class StreamingVAE:
    """Wan 2.1 VAE with a persistent decoder feature cache for block-by-block video decoding."""

    def __init__(self, model: AutoencoderKLWan, *, source: str | None = None) -> None:
        if getattr(model.config, "is_residual", False) or model.config.z_dim != 16:
            raise ConfigError("StreamingVAE supports the Wan 2.1 VAE (z_dim 16) only, not the Wan 2.2 VAE.")
        self.model = model.eval().requires_grad_(False)
        self.source = source
        p = next(model.parameters())
        self.device: torch.device = p.device
        self.dtype: torch.dtype = p.dtype
        self.z_dim: int = int(model.config.z_dim)
        self.spatial_factor: int = 2 ** sum(1 for _ in model.config.temperal_downsample)
        self.temporal_factor: int = 2 ** sum(bool(t) for t in model.config.temperal_downsample)
        shape = (1, self.z_dim, 1, 1, 1)
        self._mean = torch.tensor(model.config.latents_mean, dtype=torch.float32, device=self.device).view(shape)
        self._std = torch.tensor(model.config.latents_std, dtype=torch.float32, device=self.device).view(shape)
        self._n_dec = int(model._cached_conv_counts["decoder"])
        self._n_enc = int(model._cached_conv_counts["encoder"])
        self.reset()

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "auto",
             dtype: str | torch.dtype | None = "auto") -> StreamingVAE:
        """Load a Wan 2.1 VAE from an original-key file (.safetensors/.pth), a diffusers folder or file."""
        path = Path(path).expanduser()
        if not path.exists():
            near = ""
            if path.parent.is_dir():
                cands = sorted(p.name for p in path.parent.iterdir() if p.suffix.lower() in _VAE_SUFFIXES)
                near = f" Files in {path.parent}: {', '.join(cands[:10]) or 'none'}."
            raise ModelFileError(
                f"VAE file not found: {path}.{near} Put wan_2.1_vae.safetensors into models/vae/."
            )
        dev = resolve_device(device, what="VAE")
        dt = parse_dtype(dtype, default=default_compute_dtype(dev))
        if not isinstance(dt, torch.dtype):
            raise ConfigError(f"The VAE does not support the weight dtype {dtype!r}; use fp32, bf16 or fp16.")
        sd, cfg_hint, fmt = _load_state(path)
        # Cast before assigning so the module is built in the user dtype (no fp32 copy of a large VAE).
        sd = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in sd.items()}
        model = _build_model(path, sd, cfg_hint).to(device=dev)
        logger.info("Loaded Wan 2.1 VAE from %s (%s) on %s as %s", path, fmt, dev, dt)
        return cls(model, source=str(path))

    # ---- latent normalization ------------------------------------------------------------------------------
    def _check_channels(self, latents: torch.Tensor, what: str) -> None:
        if not torch.is_tensor(latents) or latents.ndim != 5 or latents.shape[1] != self.z_dim:
            shape = tuple(latents.shape) if torch.is_tensor(latents) else type(latents).__name__
            raise ConfigError(f"{what} needs latents [B, {self.z_dim}, F, h, w]; got {shape}.")

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (what the DiTs see) → the raw VAE latent space: ``z * std + mean`` per channel.

        The raw space is ComfyUI's LATENT convention for Wan 2.1 (its ``Wan21`` latent format normalizes on the way
        in), so core ``VAEDecode`` with the Wan VAE decodes the result. Returns float32 on the input's device.
        """
        self._check_channels(latents, "denormalize")
        x = latents.to(torch.float32)
        return x * self._std.to(x.device) + self._mean.to(x.device)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`denormalize`: raw VAE latents → normalized ``(z - mean) / std`` (float32, input's device)."""
        self._check_channels(latents, "normalize")
        x = latents.to(torch.float32)
        return (x - self._mean.to(x.device)) / self._std.to(x.device)

    # ---- streaming decode ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new video: empty decoder feature cache."""
        self._cache: list = [None] * self._n_dec
        self._frames_decoded = 0
        self._spatial: tuple[int, int] | None = None

    @property
    def frames_decoded(self) -> int:
        """Latent frames decoded since the last ``reset``."""
        return self._frames_decoded

    def pixel_frames_for(self, n_latent: int, *, first: bool | None = None) -> int:
        """Pixel frames a ``decode_block`` of ``n_latent`` frames yields now (or as the first block)."""
        first = self._frames_decoded == 0 if first is None else first
        return latent_to_pixel_frames(n_latent) if first else 4 * int(n_latent)

    def _check_latents(self, latents: torch.Tensor) -> None:
        if not torch.is_tensor(latents) or not latents.is_floating_point():
            raise ConfigError(f"decode_block needs a float tensor of latents [1, {self.z_dim}, F, h, w], "
                              f"got {type(latents).__name__} {getattr(latents, 'dtype', '')}.")
        if latents.ndim != 5:
            raise ConfigError(f"decode_block needs latents shaped [1, {self.z_dim}, F, h, w]; got shape "
                              f"{tuple(latents.shape)} ({latents.ndim} dims).")
        b, c, f, h, w = latents.shape
        if b != 1:
            raise ConfigError(f"decode_block decodes one video (batch 1); got batch {b} in {tuple(latents.shape)}.")
        if c != self.z_dim:
            raise ConfigError(f"decode_block needs {self.z_dim} latent channels (Wan 2.1); got {c} in "
                              f"{tuple(latents.shape)}. Is this a Wan 2.2 latent or the wrong axis order?")
        if f < 1 or h < 1 or w < 1:
            raise ConfigError(f"decode_block got an empty latent {tuple(latents.shape)}.")
        if self._spatial is not None and (h, w) != self._spatial:
            raise ConfigError(f"Latent size changed mid-video from {self._spatial} to {(h, w)}; call reset() "
                              "before decoding a new video.")

    @torch.no_grad()
    def decode_block(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next block of normalized latents ``[1,16,F,h,w]`` into frames ``[N,H,W,3]`` in [0, 1].

        N = 1 + 4(F-1) for the first block after ``reset`` and 4F afterwards. The output stays on the VAE device
        (float32).
        """
        self._check_latents(latents)
        z = self.denormalize(latents.to(device=self.device))
        x = self.model.post_quant_conv(z.to(self.dtype))
        dec = self.model.decoder
        # Work on a fresh list and commit it only when the whole block decoded: an exception (OOM, cancel)
        # leaves the stream exactly where it was.
        cache = list(self._cache)
        outs = []
        for i in range(x.shape[2]):
            outs.append(dec(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0],
                            first_chunk=self._frames_decoded + i == 0))
        self._cache = cache
        self._frames_decoded += len(outs)
        self._spatial = (int(latents.shape[3]), int(latents.shape[4]))
        video = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        frames = (video[0].float().clamp(-1.0, 1.0) + 1.0) * 0.5       # [3, N, H, W]
        return frames.permute(1, 2, 3, 0).contiguous()

    # ---- snapshots -----------------------------------------------------------------------------------------
    def snapshot(self) -> VAEState:
        """References to the current cache entries (no tensor copies): O(number of convs)."""
        return VAEState(tuple(self._cache), self._frames_decoded, self._spatial, id(self))

    def restore(self, state: VAEState) -> None:
        """Put the decoder back where ``snapshot`` found it (e.g. after a rejected draft)."""
        if not isinstance(state, VAEState):
            raise ConfigError(f"restore() needs a VAEState from snapshot(), got {type(state).__name__}.")
        if state.owner != id(self) or len(state.entries) != self._n_dec:
            raise ConfigError("restore() got a VAEState taken from a different StreamingVAE.")
        self._cache = list(state.entries)
        self._frames_decoded = state.frames_decoded
        self._spatial = state.spatial

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the live decoder feature cache."""
        return _entries_nbytes(self._cache)

    @staticmethod
    def snapshot_nbytes(state: VAEState) -> int:
        """Bytes referenced by a snapshot (shared with the live cache, not extra memory)."""
        return state.nbytes

    # ---- encode --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_frame(self, image: torch.Tensor) -> torch.Tensor:
        """Encode one frame ``[1,H,W,3]`` in [0,1] as the first frame of a fresh causal stream.

        Returns the normalized posterior mean ``[1,16,1,H/8,W/8]`` (float32, on the VAE device): no sampling.
        """
        if not torch.is_tensor(image) or not image.is_floating_point() or image.ndim != 4 \
                or image.shape[0] != 1 or image.shape[3] != 3:
            raise ConfigError("encode_frame needs one float image [1, H, W, 3] in [0, 1]; got "
                              f"{tuple(image.shape) if torch.is_tensor(image) else type(image).__name__}.")
        h, w = int(image.shape[1]), int(image.shape[2])
        s = self.spatial_factor
        if h % s or w % s:
            raise ConfigError(f"encode_frame needs H and W divisible by {s}; got {h}x{w}.")
        x = image.to(device=self.device, dtype=torch.float32).mul(2.0).sub(1.0)
        x = x.permute(0, 3, 1, 2).unsqueeze(2).to(self.dtype)          # [1, 3, 1, H, W]
        cache: list = [None] * self._n_enc
        enc = self.model.quant_conv(self.model.encoder(x, feat_cache=cache, feat_idx=[0]))
        mu = enc[:, : self.z_dim].float()
        return self.normalize(mu)

    def __repr__(self) -> str:
        cfg = self.model.config
        return (f"StreamingVAE(base_dim={cfg.base_dim}, z_dim={cfg.z_dim}, device={self.device}, "
                f"dtype={self.dtype}, source={self.source!r})")


# --------------------------------------------------------------------------------------------------------------
# Tiny test VAE
# --------------------------------------------------------------------------------------------------------------

def build_tiny_vae_model(seed: int = TINY_VAE_SEED) -> AutoencoderKLWan:
    """The tiny random Wan 2.1 VAE (diffusers module, fp32), deterministic for a seed, global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoencoderKLWan(**TINY_VAE_CONFIG)
        with torch.no_grad():
            # RMS-norm gains around 1 (not exactly 1) so the norms are exercised by the tests.
            for name, p in model.named_parameters():
                if name.endswith("gamma"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def write_tiny_vae(models_dir: str | Path) -> Path:
    """Write ``models_dir/vae/sdvg_tiny_vae.safetensors``: a tiny Wan 2.1 VAE in the original (Comfy-Org) keys."""
    from safetensors.torch import save_file

    out_dir = Path(models_dir) / "vae"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TINY_VAE_FILENAME
    sd = {k: v.detach().contiguous() for k, v in build_tiny_vae_model().state_dict().items()}
    original = wan_vae_to_original_keys(sd)
    meta = {"sdvg_kind": "wan2.1_vae_tiny", "sdvg_config": json.dumps(TINY_VAE_CONFIG),
            "sdvg_seed": str(TINY_VAE_SEED)}
    tmp = path.with_suffix(".tmp")
    save_file(original, str(tmp), metadata=meta)
    tmp.replace(path)
    logger.info("Wrote tiny Wan 2.1 VAE to %s (%d tensors)", path, len(original))
    return path
