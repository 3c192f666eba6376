"""A linear patch latent model with the streaming Wan VAE's interface: the toy world's "VAE".

It is **not** a Wan VAE. Each latent cell holds 16 principal components of an 8×8 pixel patch: of one frame for
the first latent frame of a video, of 4 frames for every later one (the Wan 2.1 shape: 16 channels, 8× spatial,
4× temporal with the first frame alone). Decoding a latent frame needs no earlier one, so the streaming decoder has
no feature cache: ``snapshot``/``restore`` carry only the frame count. The bases are fitted by PCA on toy-world
renders (``sdvg.toy.train``); a trained Wan VAE did not fit the CPU budget (the issue's prototype: ~13 s per step
at width 8).

File: a safetensors file with ``first.basis [16, 192]``, ``first.mean [192]``, ``group.basis [16, 768]``,
``group.mean [768]``, ``latents_mean [16]``, ``latents_std [16]`` and the metadata ``sdvg_kind =
"sdvg_patch_vae"``, read and written by ``loaders/patch_vae.py``; :func:`sdvg.loaders.open_vae` recognises it and
the Wan loaders refuse it by name.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .vae import StreamingVAE

KIND = "sdvg_patch_vae"
Z = 16
PATCH = 8
GROUP = 4
KEYS = ("first.basis", "first.mean", "group.basis", "group.mean", "latents_mean", "latents_std")


def to_patches(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, W, 3]`` → ``[h·w, n·8·8·3]`` patch vectors (time, row, column, channel order)."""
    n, hh, ww, _ = x.shape
    p = x.reshape(n, hh // PATCH, PATCH, ww // PATCH, PATCH, 3).permute(1, 3, 0, 2, 4, 5)
    return p.reshape((hh // PATCH) * (ww // PATCH), -1)


def from_patches(p: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`to_patches` for an ``h × w`` latent grid of ``n`` frames."""
    x = p.reshape(h, w, n, PATCH, PATCH, 3).permute(2, 0, 3, 1, 4, 5)
    return x.reshape(n, h * PATCH, w * PATCH, 3)


class PatchLatentModel(torch.nn.Module):
    """The bases and means as (frozen) parameters, so device moves and ComfyUI's model management see them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for key in KEYS:
            self.register_parameter(key.replace(".", "_"), torch.nn.Parameter(tensors[key].clone(), requires_grad=False))


class PatchVAE(StreamingVAE):
    """The patch latent model behind the ``StreamingVAE`` interface (decode per block, snapshot/restore, encode)."""

    def __init__(self, model: PatchLatentModel, *, source: str | None = None) -> None:  # noqa: D107
        self.model = model.eval().requires_grad_(False)
        self.source = source
        p = model.first_basis
        self.device, self.dtype = p.device, p.dtype
        self.z_dim, self.spatial_factor, self.temporal_factor = Z, PATCH, GROUP
        shape = (1, Z, 1, 1, 1)
        self._mean = model.latents_mean.detach().float().view(shape)
        self._std = model.latents_std.detach().float().view(shape)
        self._n_dec = self._n_enc = 0
        self._upsample_slot = None
        self.reset()

    # ---- the linear maps -----------------------------------------------------------------------------------
    def _maps(self, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        return (m.first_basis, m.first_mean) if first else (m.group_basis, m.group_mean)

    def _encode(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        """Raw latent ``[16, h, w]`` of one group of pixel frames ``[n, H, W, 3]`` in [-1, 1]."""
        basis, mean = self._maps(first)
        z = (to_patches(x) - mean) @ basis.T
        return z.T.reshape(Z, x.shape[1] // PATCH, x.shape[2] // PATCH)

    def _decode(self, z: torch.Tensor, first: bool) -> torch.Tensor:
        """Pixel frames ``[n, H, W, 3]`` in [-1, 1] of one raw latent frame ``[16, h, w]``."""
        basis, mean = self._maps(first)
        h, w = z.shape[1:]
        p = z.reshape(Z, h * w).T @ basis + mean
        return from_patches(p, 1 if first else GROUP, h, w)

    # ---- streaming decode ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_block(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next block of normalized latents ``[1,16,F,h,w]`` into frames ``[N,H,W,3]`` in [0, 1]
        (N = 1 + 4(F-1) for the first block after ``reset``, 4F afterwards)."""
        self._check_latents(latents)
        z = self.denormalize(latents.to(device=self.device))[0]
        outs = [self._decode(z[:, i], self._frames_decoded + i == 0) for i in range(z.shape[1])]
        self._frames_decoded += len(outs)
        self._spatial = (int(latents.shape[3]), int(latents.shape[4]))
        return ((torch.cat(outs).clamp(-1.0, 1.0) + 1.0) * 0.5).contiguous()

    # ---- encode --------------------------------------------------------------------------------------------
    def _check_image_size(self, h: int, w: int, what: str) -> None:
        if h % PATCH or w % PATCH:
            raise ConfigError(f"{what} needs H and W divisible by {PATCH}; got {h}x{w}.")

    @torch.no_grad()
    def encode_frame(self, image: torch.Tensor) -> torch.Tensor:
        """One frame ``[1,H,W,3]`` in [0,1] as the first latent frame of a video: normalized ``[1,16,1,H/8,W/8]``."""
        if not torch.is_tensor(image) or not image.is_floating_point() or image.ndim != 4 \
                or image.shape[0] != 1 or image.shape[3] != 3:
            raise ConfigError("encode_frame needs one float image [1, H, W, 3] in [0, 1]; got "
                              f"{tuple(image.shape) if torch.is_tensor(image) else type(image).__name__}.")
        self._check_image_size(image.shape[1], image.shape[2], "encode_frame")
        x = image.to(self.device, torch.float32) * 2 - 1
        return self.normalize(self._encode(x, True)[None, :, None])

    @torch.no_grad()
    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """A clip ``[N,H,W,3]`` in [0,1] with N = 1 + 4k → normalized latents ``[1,16,1+k,H/8,W/8]``."""
        if not torch.is_tensor(frames) or not frames.is_floating_point() or frames.ndim != 4 or frames.shape[3] != 3 \
                or (frames.shape[0] - 1) % GROUP:
            raise ConfigError("encode_video needs float frames [N, H, W, 3] in [0, 1] with N = 1 + 4k; got "
                              f"{tuple(frames.shape) if torch.is_tensor(frames) else type(frames).__name__}.")
        self._check_image_size(frames.shape[1], frames.shape[2], "encode_video")
        x = frames.to(self.device, torch.float32) * 2 - 1
        zs = [self._encode(x[:1], True)] + [self._encode(x[i:i + GROUP], False) for i in range(1, x.shape[0], GROUP)]
        return self.normalize(torch.stack(zs, dim=1)[None])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's tensors (what :func:`write_patch_vae` writes)."""
        return {k: getattr(self.model, k.replace(".", "_")).detach().cpu() for k in KEYS}

    def __repr__(self) -> str:
        return f"PatchVAE(patch latent model, z_dim=16, device={self.device}, source={self.source!r})"


# ----------------------------------------------------------------------------------------------------------
# fitting (used by the toy world's training; ``loaders.patch_vae.write_patch_vae`` writes the file)


def fit_patch_bases(clips: torch.Tensor, *, per_channel: bool = False) -> dict[str, torch.Tensor]:
    """PCA bases from clips ``[B, 1 + 4k, H, W, 3]`` in [0, 1]. The latents are scaled by one global factor (unit
    mean variance), so the DiTs' latent MSE is the pixel MSE of the kept part; ``per_channel``: each channel to unit
    variance instead (Wan's per-channel ``latents_std``), so every component weighs the same in the DiTs' loss and
    keeps its signal-to-noise ratio at a given noise level."""
    x = clips.float() * 2 - 1
    first, groups = _first_and_group_patches(x)
    out: dict[str, torch.Tensor] = {}
    var = []
    for name, data in (("first", first), ("group", groups)):
        data = data.double()
        mean = data.mean(0)
        _, s, vh = torch.linalg.svd(data - mean, full_matrices=False)
        out[f"{name}.basis"] = vh[:Z].float().contiguous()
        out[f"{name}.mean"] = mean.float()
        var.append((s[:Z] ** 2 / (data.shape[0] - 1)).float())
    out["latents_mean"] = torch.zeros(Z)
    if per_channel:
        out["latents_std"] = channel_variances(out, clips).sqrt()
    else:
        out["latents_std"] = torch.full((Z,), float(torch.cat(var).mean().sqrt()))
    return out


def channel_variances(tensors: dict[str, torch.Tensor], clips: torch.Tensor) -> torch.Tensor:
    """``[16]``: each raw latent channel's variance over every latent frame of ``clips`` (first frames and 4-frame
    groups pooled, each latent frame counted once) under the bases in ``tensors``."""
    first, groups = _first_and_group_patches(clips.float() * 2 - 1)
    sq = torch.zeros(Z, dtype=torch.float64)
    for name, data in (("first", first), ("group", groups)):
        z = (data.double() - tensors[f"{name}.mean"].double()) @ tensors[f"{name}.basis"].double().T
        sq += z.pow(2).sum(0)
    return (sq / (first.shape[0] + groups.shape[0] - 1)).float()


def _first_and_group_patches(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The patch vectors of every clip's first frame and of its 4-frame groups (``x`` in [-1, 1])."""
    first = torch.cat([to_patches(c[:1]) for c in x])
    groups = torch.cat([to_patches(c[i:i + GROUP]) for c in x for i in range(1, c.shape[0], GROUP)])
    return first, groups
