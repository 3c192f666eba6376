"""The toy world's patch latent model files (``models/patch_vae.py``): recognised by their metadata, read and
written. A safetensors file with the bases, means and latent statistics and ``sdvg_kind = "sdvg_patch_vae"``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..devices import default_compute_dtype, parse_dtype, resolve_device
from ..errors import ConfigError, ModelFileError
from ..models.patch_vae import KEYS, KIND, PatchLatentModel, PatchVAE
from .checkpoint import load_checkpoint
from .safetensors_io import read_safetensors_header

logger = logging.getLogger(__name__)


def is_patch_vae_file(path: str | Path) -> bool:
    """Whether ``path`` is a patch latent file (by its safetensors metadata; reads the header only)."""
    p = Path(path)
    if p.is_dir() or p.suffix != ".safetensors" or not p.is_file():
        return False
    try:
        meta = read_safetensors_header(p).metadata
    except (OSError, ValueError, ModelFileError):
        return False
    return meta.get("sdvg_kind") == KIND


def load_patch_vae(path: str | Path, *, device: str | torch.device = "auto",
                   dtype: str | torch.dtype | None = "auto") -> PatchVAE:
    """The patch latent model in ``path`` (fp32 only)."""
    path = Path(path).expanduser()
    dev = resolve_device(device, what="VAE")
    dt = parse_dtype(dtype, default=default_compute_dtype(dev))
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"The patch latent model does not support the weight dtype {dtype!r}; use fp32.")
    ck = load_checkpoint(path)
    missing = [k for k in KEYS if k not in ck.tensors]
    if missing:
        raise ModelFileError(f"{path}: a patch latent file without {', '.join(missing)}; rewrite it with "
                             "`python -m sdvg toy train`.")
    model = PatchLatentModel({k: ck.tensors[k].float() for k in KEYS}).to(device=dev, dtype=torch.float32)
    logger.info("Loaded the patch latent model %s on %s", path, dev)
    return PatchVAE(model, source=str(path))


def write_patch_vae(tensors: dict[str, torch.Tensor], path: str | Path, *, note: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"sdvg_kind": KIND, "sdvg_note": json.dumps(note or {})}
    save_file({k: tensors[k].contiguous() for k in KEYS}, str(path), metadata=meta)
    return path
