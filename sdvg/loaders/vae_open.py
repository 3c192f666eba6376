"""Open a VAE file as a streaming decoder: the Wan 2.1 VAE (:class:`~sdvg.models.StreamingVAE`) or the toy world's
patch latent model (:class:`~sdvg.models.PatchVAE`), recognised by its metadata."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.vae import StreamingVAE
from .patch_vae import is_patch_vae_file, load_patch_vae
from .vae import load_streaming_vae


def open_vae(path: str | Path, *, device: str | torch.device = "auto",
             dtype: str | torch.dtype | None = "auto") -> StreamingVAE:
    """The streaming VAE in ``path``: a patch latent file when its metadata says so, else a Wan 2.1 VAE."""
    if is_patch_vae_file(Path(path).expanduser()):
        return load_patch_vae(path, device=device, dtype=dtype)
    return load_streaming_vae(path, device=device, dtype=dtype)
