"""Open a VAE file as a streaming decoder: the Wan 2.1 VAE (:class:`~sdvg.vae.StreamingVAE`) or the toy world's
patch latent model (:class:`~sdvg.patch_vae.PatchVAE`), recognised by its metadata."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.patch_vae import PatchVAE, is_patch_vae_file
from ..models.vae import StreamingVAE


def open_vae(path: str | Path, *, device: str | torch.device = "auto",
             dtype: str | torch.dtype | None = "auto") -> StreamingVAE:
    """The streaming VAE in ``path``: a patch latent file when its metadata says so, else a Wan 2.1 VAE."""
    if is_patch_vae_file(Path(path).expanduser()):
        return PatchVAE.load(path, device=device, dtype=dtype)
    return StreamingVAE.load(path, device=device, dtype=dtype)
