"""Streaming Wan 2.1 VAE: block-by-block decode with a persistent causal feature cache.

The layers are diffusers' ``AutoencoderKLWan``; this module owns only the streaming glue (SPEC §3):

* ``decode_block`` runs ``post_quant_conv`` and then the decoder one latent frame at a time with a feature
  cache that lives across blocks. ``AutoencoderKLWan.decode()`` clears that cache on entry and exit, so it is
  never called here.
* The decoder *replaces* cache entries (``feat_cache[i] = new_tensor``) and never writes into them, so a
  snapshot is a tuple of references (no tensor copies) and ``restore`` puts those references back.
* ``reset(decoder="krea")`` starts a stream with Krea's decoder variant (``compat.py``): its first temporal
  upsampler caches the current frame twice (``where(previous == 0, 0, current)``, then current) where the Wan VAE
  caches the previous and the current frame. Pixel frames 0–8 are identical; from frame 9 on they drift.
* ``encode_frame`` encodes one pixel frame as the first frame of a fresh causal encoder stream (used by the
  windowed-recompute regime to re-encode an old frame as context).

Reading VAE files (every key layout, config from shapes) is ``loaders/vae.py``: ``load_streaming_vae`` builds this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError

if TYPE_CHECKING:  # the layers come with the model; this module itself needs no diffusers
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

logger = logging.getLogger(__name__)

__all__ = ["StreamingVAE", "VAEState", "latent_to_pixel_frames"]


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


DECODERS = ("wan", "krea")


def _krea_cache_entry(cache: list, slot: int | None) -> None:
    """Krea's first temporal upsampler cache after a one-frame call: ``[where(prev == 0, 0, cur), cur]`` instead
    of the Wan VAE's ``[prev, cur]`` (diffusers wrote ``[prev, cur]``; the entry is replaced, never mutated)."""
    entry = cache[slot] if slot is not None else None
    if not torch.is_tensor(entry) or entry.shape[2] != 2:
        return
    cur = entry[:, :, 1:]
    cache[slot] = torch.cat([torch.where(entry[:, :, :1] == 0, torch.zeros_like(cur), cur), cur], dim=2)


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
        self._upsample_slot: int | None = None  # cache slot of the first temporal upsampler (found on first decode)
        self.reset()

    # ---- loading -------------------------------------------------------------------------------------------
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
    def reset(self, *, decoder: str = "wan") -> None:
        """Start a new video: empty decoder feature cache. ``decoder``: "wan" (exact) or "krea" (Krea's variant)."""
        if decoder not in DECODERS:
            raise ConfigError(f"Unknown VAE decoder variant {decoder!r}. Valid: {', '.join(DECODERS)}.")
        self.decoder_variant = decoder
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
            first = self._frames_decoded + i == 0
            outs.append(dec(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first))
            if first and self._upsample_slot is None:  # the upsamplers mark their slot 'Rep' on the first frame
                self._upsample_slot = next((j for j, e in enumerate(cache) if isinstance(e, str)), None)
            if not first and self.decoder_variant == "krea":
                _krea_cache_entry(cache, self._upsample_slot)
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

    @torch.no_grad()
    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """Encode a clip ``[N, H, W, 3]`` in [0, 1] (N = 1 + 4k) as one causal stream: the first frame alone, then 4
        frames per latent frame. Returns the normalized posterior mean ``[1, 16, 1 + k, H/8, W/8]`` (float32)."""
        if not torch.is_tensor(frames) or not frames.is_floating_point() or frames.ndim != 4 or frames.shape[3] != 3 \
                or (frames.shape[0] - 1) % 4:
            raise ConfigError("encode_video needs float frames [N, H, W, 3] in [0, 1] with N = 1 + 4k; got "
                              f"{tuple(frames.shape) if torch.is_tensor(frames) else type(frames).__name__}.")
        s = self.spatial_factor
        if frames.shape[1] % s or frames.shape[2] % s:
            raise ConfigError(f"encode_video needs H and W divisible by {s}; got {frames.shape[1]}x{frames.shape[2]}.")
        cache: list = [None] * self._n_enc
        outs = []
        for start, stop in [(0, 1)] + [(i, i + 4) for i in range(1, frames.shape[0], 4)]:
            x = frames[start:stop].to(device=self.device, dtype=torch.float32).mul(2.0).sub(1.0)
            x = x.permute(3, 0, 1, 2).unsqueeze(0).to(self.dtype)  # [1, 3, n, H, W]
            outs.append(self.model.encoder(x, feat_cache=cache, feat_idx=[0]))
        enc = self.model.quant_conv(torch.cat(outs, dim=2))
        return self.normalize(enc[:, : self.z_dim].float())

    def __repr__(self) -> str:
        cfg = self.model.config
        return (f"StreamingVAE(base_dim={cfg.base_dim}, z_dim={cfg.z_dim}, device={self.device}, "
                f"dtype={self.dtype}, source={self.source!r})")
