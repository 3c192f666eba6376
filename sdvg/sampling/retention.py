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

from ..blocks import pixel_frames_for_blocks
from .results import FrameBuffer, FrameTail
from .router import runs_model

CATCH_UP_BACKLOG = 8


def output_store(config) -> FrameBuffer | FrameTail:
    """Every frame (``keep_output``), or the last blocks' only (the frames reach ``on_block``; stream them out)."""
    if config.keep_output:
        return FrameBuffer(pixel_frames_for_blocks(config.num_blocks), config.height, config.width)
    return FrameTail(config.height, config.width)


def footprint(run) -> dict:
    """What the run holds now: KV-cache bytes and frames per model, history blocks, output frames, VAE bytes."""
    dens = {name: den for name, den in run.denoisers.items() if den.kv is not None}
    frames = run.frames
    return {"kv_bytes": {n: d.kv.nbytes for n, d in dens.items()}, "kv_frames": {n: len(d.kv.frames) for n, d in dens.items()},
            "history_blocks": len(run.history.blocks),
            "frames_held": frames.held_frames if isinstance(frames, FrameTail) else frames.count,
            "vae_bytes": run.vae.cache_nbytes}


def drop_old_history(run, timings: dict) -> None:
    """Forget the latents no cache will read any more (keeping the last two blocks)."""
    hist = run.history
    keep = len(hist) - 2
    for name, den in run.denoisers.items():
        if not runs_model(run.router.config.mode, name):
            continue
        need = den.policy.needed_from(den, hist)
        if len(hist) - need > CATCH_UP_BACKLOG:
            with run.meter.phase(timings, "cache", den.device):
                den.sync(hist)
            need = den.policy.needed_from(den, hist)
        keep = min(keep, need)
    hist.drop_before(keep)
