"""Keeping a run's memory flat in the block count (``SamplerConfig.keep_output=False``).

What a run holds while it runs:

Every per-run store is bounded: the KV caches (the policy's layout), the VAE decoder state (a fixed set of conv
feature caches), the re-encoded context frames (``context_frames``: the last few), the noise bank (two blocks), and
with ``keep_output=False`` the output frames (:class:`results.FrameTail`: the last two blocks) and the history: a
block's latents are dropped once no cache will read them. A model that has not run for ``CATCH_UP_BACKLOG`` blocks
(the target while drafts are accepted, in the noisy and global regimes) writes its backlog into its cache early: the
same forwards, in the same order, that it would run when it is next needed, so the video is unchanged, and the
history it would have read can go. Only the per-block records (a few hundred bytes each) grow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..blocks import pixel_frames_for_blocks
from .history import BlockHistory
from .meter import RunMeter
from .results import FrameBuffer, FrameTail

if TYPE_CHECKING:
    from ..models.vae import StreamingVAE
    from .causal import BlockDenoiser
    from .config import SamplerConfig

CATCH_UP_BACKLOG = 8


def output_store(config: SamplerConfig) -> FrameBuffer | FrameTail:
    """Every frame (``keep_output``), or the last blocks' only (the frames reach ``on_block``; stream them out)."""
    if config.keep_output:
        return FrameBuffer(pixel_frames_for_blocks(config.num_blocks), config.height, config.width)
    return FrameTail(config.height, config.width)


def footprint(denoisers: Mapping[str, BlockDenoiser], history: BlockHistory, frames: FrameBuffer | FrameTail,
              vae: StreamingVAE) -> dict:
    """What the run holds now: KV-cache bytes and frames per model, history blocks, output frames, VAE bytes."""
    dens = {name: den for name, den in denoisers.items() if den.kv is not None}
    return {"kv_bytes": {n: d.kv.nbytes for n, d in dens.items()}, "kv_frames": {n: len(d.kv.frames) for n, d in dens.items()},
            "history_blocks": len(history.blocks),
            "frames_held": frames.held_frames if isinstance(frames, FrameTail) else frames.count,
            "vae_bytes": vae.cache_nbytes}


def drop_old_history(history: BlockHistory, denoisers: Sequence[BlockDenoiser], meter: RunMeter,
                     timings: dict) -> None:
    """Forget the latents no cache of ``denoisers`` (the models the routing mode runs) will read any more, keeping
    the last two blocks."""
    keep = len(history) - 2
    for den in denoisers:
        need = den.policy.needed_from(den, history)
        if len(history) - need > CATCH_UP_BACKLOG:
            with meter.phase(timings, "cache", den.device):
                den.sync(history)
            need = den.policy.needed_from(den, history)
        keep = min(keep, need)
    history.drop_before(keep)
