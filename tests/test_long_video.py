"""Long videos on the tiny models: flat memory in the block count, window-relative RoPE, pinned sinks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.retention import CATCH_UP_BACKLOG
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPT = "a red fox running through snow"
SIZE = 16


def sampler(models, *, blocks, regime="recompute", mode="target-only", tau=-0.7, keep=True, positions="absolute",
            window=12, sinks=3, **kw):
    cache = CacheConfig(regime=regime, window_frames=window, sink_frames=sinks, positions=positions)
    config = SamplerConfig(num_blocks=blocks, width=SIZE, height=SIZE, cache=cache, keep_output=keep, **kw)
    return SpeculativeSampler(models, RouterConfig(mode=mode, tau=tau), config)


@pytest.mark.parametrize("regime", ["recompute", "noisy"])
def test_112_blocks_run_in_flat_memory(tiny_models, regime):
    """Every per-run store stays the same size from block 8 to block 112: KV cache, history, held frames, VAE
    decoder state (the process' peak RSS over 7/28/112 blocks: bench/long_video.py, docs/PERFORMANCE.md)."""
    s = sampler(tiny_models, blocks=112, regime=regime, mode="draft-only", keep=False, schedule="1000,500",
                positions="window" if regime == "noisy" else "absolute")
    seen, frames_out = [], 0

    def on_block(ev):
        nonlocal frames_out
        frames_out += ev.frames.shape[0]
        if ev.block in (8, 111):
            seen.append(ev.footprint)

    s.run(PROMPT, on_block=on_block)
    early, late = seen
    assert frames_out == 12 * 112 - 3
    for key in ("kv_bytes", "kv_frames", "history_blocks", "frames_held", "vae_bytes"):
        assert late[key] == early[key], key
    assert early["history_blocks"] <= 3 and early["frames_held"] <= 24


def short_table(dit, frames: int):
    """A copy of a tiny DiT whose RoPE table holds ``frames`` positions (same weights)."""
    model = copy.deepcopy(dit)
    model.register_to_config(rope_max_seq_len=frames)
    return model


def test_window_positions_run_past_the_rope_table_absolute_ones_are_refused(tiny_models):
    models = copy.copy(tiny_models)
    models.drafter = short_table(tiny_models.drafter, 12)
    with pytest.raises(ConfigError, match="window-relative positions"):
        sampler(models, blocks=6, regime="noisy", mode="draft-only", window=9)
    result = sampler(models, blocks=6, regime="noisy", mode="draft-only", window=9, positions="window").run(PROMPT)
    assert len(result.blocks) == 6 and torch.isfinite(result.latents).all()  # 18 frames on a 12-position table
    with pytest.raises(ConfigError, match="absolute RoPE position"):
        CacheConfig(regime="global", positions="window")


def test_window_positions_equal_absolute_ones_until_the_window_rolls(tiny_models):
    kw = dict(blocks=6, regime="noisy", mode="draft-only", window=9, sinks=3, schedule="1000,500")
    absolute = sampler(tiny_models, **kw).run(PROMPT)
    window = sampler(tiny_models, positions="window", **kw).run(PROMPT)
    # blocks 0-2 fill the 9-frame window: same positions, bit-identical; block 3 evicts and is roped at slots 6..8
    assert torch.equal(window.latents[:, :, :9], absolute.latents[:, :, :9])
    assert not torch.equal(window.latents[:, :, 9:12], absolute.latents[:, :, 9:12])


def test_streamed_output_is_the_kept_output(tiny_models):
    """keep_output=False hands on the same frames block by block; a model that lags behind (the target while every
    draft is accepted, noisy regime) catches up early so the history can be dropped, with the same result."""
    kw = dict(blocks=12, regime="noisy", mode="reward", tau=-math.inf, schedule="1000,500")
    kept = sampler(tiny_models, **kw).run(PROMPT)
    streamed, held = [], []

    def on_block(ev):
        streamed.append(ev.frames)
        held.append(ev.footprint["history_blocks"])

    result = sampler(tiny_models, keep=False, **kw).run(PROMPT, on_block=on_block)
    assert max(held) <= CATCH_UP_BACKLOG + 2 < 12  # the target's backlog was written early, then dropped
    assert result.frames.shape[0] == 0 and result.latents.numel() == 0
    assert torch.equal(torch.cat(streamed), kept.frames)
    assert [b.decision for b in result.blocks] == [b.decision for b in kept.blocks]


def test_window_positions_pipelined_equals_plain(tiny_models):
    """Pipelined drafting evicts from the rolling window before a block is decided; the undo of a rejected draft's
    eviction is a plain copy of un-roped keys, so the video is the plain loop's."""
    kw = dict(blocks=6, regime="noisy", mode="reward", tau=-0.7, window=9, positions="window", schedule="1000,500")
    plain = sampler(tiny_models, **kw).run(PROMPT)
    piped = sampler(tiny_models, pipelined=True, **kw).run(PROMPT)
    assert {b.decision for b in plain.blocks[1:]} == {"accept", "reject"}
    assert torch.equal(piped.latents, plain.latents) and torch.equal(piped.frames, plain.frames)
