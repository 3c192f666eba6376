"""The preallocated self-attention KV cache: global and rolling (pinned sinks) layouts, in-place writes, the one-write
undo of an eviction that pipelined drafting needs, sizes."""

from __future__ import annotations

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.models.kv_cache import SelfKVCache, kv_cache_nbytes


def _marked_cache(**kw) -> SelfKVCache:
    return SelfKVCache(num_layers=2, batch=1, tokens_per_frame=2, heads=1, head_dim=1, **kw)


def _write(cache: SelfKVCache, frame: int, n: int = 3) -> None:
    slots = cache.begin_write(frame, n)
    vals = torch.arange(frame, frame + n, dtype=torch.float32).repeat_interleave(cache.tokens_per_frame)
    cache.k[:, :, slots.start:slots.end] = vals.view(1, 1, -1, 1, 1)
    cache.v[:, :, slots.start:slots.end] = -vals.view(1, 1, -1, 1, 1)


def _slot_frames(cache: SelfKVCache) -> list[int]:
    tok = cache.k[0, 0, : len(cache.frames) * cache.tokens_per_frame, 0, 0]
    return [int(v) for v in tok[:: cache.tokens_per_frame]]


def test_rolling_window_evicts_and_keeps_sinks():
    cache = _marked_cache(capacity_frames=12, rolling=True, sink_frames=3)
    ptr = (cache.k.data_ptr(), cache.v.data_ptr())
    for b in range(4):
        _write(cache, 3 * b)
    assert cache.frames == list(range(12)) == _slot_frames(cache)
    _write(cache, 12)
    assert cache.frames == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14] == _slot_frames(cache)
    _write(cache, 15)
    _write(cache, 18)
    expected = [0, 1, 2, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert cache.frames == expected == _slot_frames(cache)
    assert torch.equal(cache.v, -cache.k)
    assert (cache.k[1] == cache.k[0]).all()  # every layer shifted
    _write(cache, 18)  # re-run the newest block: same slots
    assert cache.frames == expected
    with pytest.raises(ConfigError):
        cache.begin_write(6, 3)  # evicted
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptr
    small = _marked_cache(capacity_frames=5, rolling=True, sink_frames=1)
    _write(small, 0)
    _write(small, 3)  # needs 1 slot: evicts frame 1, keeps sink 0
    assert small.frames == [0, 2, 3, 4, 5] == _slot_frames(small)
    _write(small, 6)
    assert small.frames == [0, 5, 6, 7, 8] == _slot_frames(small)


def test_reset_and_nbytes():
    cache = _marked_cache(capacity_frames=6)
    _write(cache, 0)
    cache.reset()
    assert cache.frames == [] and len(cache.frames) * cache.tokens_per_frame == 0
    _write(cache, 0)
    assert cache.frames == [0, 1, 2]
    assert cache.nbytes == 2 * 2 * 6 * 2 * 1 * 1 * 4
    assert kv_cache_nbytes(num_layers=2, capacity_frames=6, tokens_per_frame=2, heads=1, head_dim=1,
                           dtype=torch.float32) == cache.nbytes
    big = kv_cache_nbytes(num_layers=30, capacity_frames=21, tokens_per_frame=1560, heads=12, head_dim=128)
    assert round(big / 1e9, 1) == 6.0
    with pytest.raises(ConfigError):
        _marked_cache(capacity_frames=3, rolling=True, sink_frames=3)


def test_rewriting_before_an_eviction_brings_the_evicted_frames_back():
    """Pipelined drafting writes block b+1 before block b is decided; if b is rejected and rewritten, the frames that
    b+1's write evicted must return, or the rewritten block would see a shorter window than a plain run."""
    plain = _marked_cache(capacity_frames=9, rolling=True, sink_frames=3)
    for b in range(3):
        _write(plain, 3 * b)
    speculative = _marked_cache(capacity_frames=9, rolling=True, sink_frames=3)
    for b in range(3):
        _write(speculative, 3 * b)
    _write(speculative, 9)  # the speculative next block evicts frames 3..5
    assert speculative.frames == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    _write(speculative, 6)  # block 2 is rewritten (rejected): 9..11 go, 3..5 come back
    _write(plain, 6)
    assert speculative.frames == plain.frames == [0, 1, 2, 3, 4, 5, 6, 7, 8] == _slot_frames(speculative)
    assert torch.equal(speculative.k, plain.k) and torch.equal(speculative.v, plain.v)
