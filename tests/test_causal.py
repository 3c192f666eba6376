"""BlockDenoiser: cache regimes, forward counts, determinism, refine-on-reject, cancellation (tiny CPU DiT)."""

from __future__ import annotations

import pytest
import torch

from sdvg.errors import CancelledError, ConfigError
from sdvg.models.dit import CausalWanTransformer
from sdvg.sampling.causal import BlockDenoiser
from sdvg.sampling.history import BlockHistory, HistoryBlock
from sdvg.sampling.regimes import CacheConfig, CacheRegime
from sdvg.sampling.scheduler import FlowMatchScheduler, build_step_schedule, renoise, sample_block_noise, to_x0

CFG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
)
SHAPE = (1, 16, 3, 8, 8)
SCHED = FlowMatchScheduler()
STEPS = SCHED.warp([1000, 750, 500, 250])


@pytest.fixture(scope="module")
def model() -> CausalWanTransformer:
    torch.manual_seed(0)
    m = CausalWanTransformer(**CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 3:
                p.normal_(0, 0.5)
    return m


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, 7, 32)


def _denoiser(model, prompt, regime, num_frames=12, **kw) -> BlockDenoiser:
    d = BlockDenoiser(model, CacheConfig(regime=regime, **kw), name=f"d-{regime}")
    d.start(prompt, latent_shape=(8, 8), num_frames=num_frames)
    return d


def _noise(block, n=4, seed=0):
    return sample_block_noise(seed, block, SHAPE, n, device="cpu", dtype=torch.float32)


def _run(d, blocks, schedule=None, history=None, seed=0):
    history = history if history is not None else BlockHistory()
    results = []
    for b in range(blocks):
        steps = schedule[b] if schedule else STEPS
        d.sync(history)
        r = d.denoise(b, _noise(b, len(steps), seed), steps)
        assert r.forwards == len(steps) + (1 if d.cache_config.regime is CacheRegime.RECOMPUTE and b else 0)
        history.append(HistoryBlock(b, r.x0, r.last_noisy, r.last_t, r.token))
        results.append(r)
    return history, results


def test_forward_counts_per_regime(model, prompt):
    g = _denoiser(model, prompt, "global")
    h, _ = _run(g, 3)
    assert g.forwards == 3 * 4 + 2
    assert g.sync(h) == 1 and g.forwards == 15  # the clean pass: one per block
    r = _denoiser(model, prompt, "recompute")
    h, _ = _run(r, 3)
    assert r.forwards == 3 * 4 + 2 and r.sync(h) == 0  # one refill per block >= 1
    diag = build_step_schedule("diagonal", 3, SCHED)
    n = _denoiser(model, prompt, CacheRegime.NOISY)
    h, _ = _run(n, 3, diag)
    assert n.forwards == 4 + 3 + 2 and n.sync(h) == 0  # own blocks: no extra forward
    other = _denoiser(model, prompt, "noisy")
    assert other.sync(h) == 3  # blocks produced elsewhere: one forward each
    assert other.sync(h) == 0


def test_global_block0_matches_manual_loop(model, prompt):
    d = _denoiser(model, prompt, "global")
    res = d.denoise(0, _noise(0), STEPS)
    kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=12)
    cross = model.prepare_cross_attention(prompt)
    noise = _noise(0)
    x = noise.initial
    for i, t in enumerate(STEPS):
        v = model.forward_block(x, torch.full((1, 3), t), kv, cross, frame_offset=0)
        x0 = to_x0(x, v, SCHED.sigma_of(t))
        last = x
        if i < 3:
            x = renoise(x0, noise.renoise[i], SCHED.sigma_of(STEPS[i + 1]))
    assert torch.equal(res.x0, x0) and torch.equal(res.last_noisy, last) and res.last_t == STEPS[-1]


def test_global_clean_pass_touches_only_its_slots(model, prompt):
    d = _denoiser(model, prompt, "global")
    h, _ = _run(d, 2)
    tpf = d.kv.tokens_per_frame
    k0, v0 = d.kv.k.clone(), d.kv.v.clone()
    assert d.sync(h) == 1
    blk = slice(3 * tpf, 6 * tpf)
    assert not torch.equal(d.kv.k[:, :, blk], k0[:, :, blk]) and not torch.equal(d.kv.v[:, :, blk], v0[:, :, blk])
    assert torch.equal(d.kv.k[:, :, : 3 * tpf], k0[:, :, : 3 * tpf])
    assert torch.equal(d.kv.k[:, :, 6 * tpf:], k0[:, :, 6 * tpf:])
    assert torch.equal(d.kv.v[:, :, : 3 * tpf], v0[:, :, : 3 * tpf])
    # the clean pass equals a masked forward of all clean latents at t = 0
    ref = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
    model.forward_blockwise_masked(h.latents(), torch.zeros(1, 6), d.cross, 3, self_kv=ref)
    torch.testing.assert_close(d.kv.k[:, :, : 6 * tpf], ref.k, atol=1e-5, rtol=1e-5)


def test_noisy_own_write_equals_foreign_sync(model, prompt):
    own = _denoiser(model, prompt, "noisy")
    h, _ = _run(own, 2, build_step_schedule("diagonal", 2, SCHED))
    other = _denoiser(model, prompt, "noisy")
    assert other.sync(h) == 2
    assert other.kv.frames == own.kv.frames == list(range(6))
    assert torch.equal(other.kv.k, own.kv.k) and torch.equal(other.kv.v, own.kv.v)


@pytest.mark.parametrize("regime", ["noisy", "global"])
def test_speculative_history_then_reject(model, prompt, regime):
    drafter = _denoiser(model, prompt, regime)
    draft0 = drafter.denoise(0, _noise(0), STEPS)
    real = BlockHistory()
    spec = real.extended(HistoryBlock(0, draft0.x0, draft0.last_noisy, draft0.last_t, draft0.token))
    assert len(real) == 0 and len(spec) == 1
    drafter.sync(spec)
    drafter.denoise(1, _noise(1), STEPS)  # drafted on top of the unverified block 0
    target = _denoiser(model, prompt, regime)
    t0 = target.denoise(0, _noise(0, seed=5), STEPS)  # block 0 rejected: the target's version wins
    real.append(HistoryBlock(0, t0.x0, t0.last_noisy, t0.last_t, t0.token))
    assert drafter.sync(real) == 1 and drafter.kv.frames == [0, 1, 2]
    fresh = _denoiser(model, prompt, regime)
    fresh.sync(real)
    assert torch.equal(drafter.kv.k[:, :, : len(drafter.kv.frames) * drafter.kv.tokens_per_frame], fresh.kv.k[:, :, : len(fresh.kv.frames) * fresh.kv.tokens_per_frame])
    assert drafter.sync(real) == 0
    assert torch.equal(drafter.denoise(1, _noise(1), STEPS).x0, fresh.denoise(1, _noise(1), STEPS).x0)


def test_noisy_rolling_window_keeps_sinks(model, prompt):
    d = _denoiser(model, prompt, "noisy", num_frames=18, window_frames=9, sink_frames=3)
    assert d.kv.capacity_frames == 9 and d.kv.rolling
    ptr = (d.kv.k.data_ptr(), d.kv.v.data_ptr())
    h = BlockHistory()
    tpf = d.kv.tokens_per_frame
    sink = prev = None
    for b in range(6):
        d.sync(h)
        r = d.denoise(b, _noise(b, 2), [1000.0, 625.0])
        h.append(HistoryBlock(b, r.x0, r.last_noisy, r.last_t, r.token))
        end = len(d.kv.frames) * d.kv.tokens_per_frame
        if b == 0:
            sink = (d.kv.k[:, :, : 3 * tpf].clone(), d.kv.v[:, :, : 3 * tpf].clone())
        if b >= 2:
            assert d.kv.frames == [0, 1, 2, 3 * b - 3, 3 * b - 2, 3 * b - 1, 3 * b, 3 * b + 1, 3 * b + 2]
            # the previous newest block was shifted left into slots 3..5, bit for bit
            assert torch.equal(d.kv.k[:, :, 3 * tpf: 6 * tpf], prev[0])
            assert torch.equal(d.kv.v[:, :, 3 * tpf: 6 * tpf], prev[1])
        assert torch.equal(d.kv.k[:, :, : 3 * tpf], sink[0]) and torch.equal(d.kv.v[:, :, : 3 * tpf], sink[1])
        prev = (d.kv.k[:, :, end - 3 * tpf: end].clone(), d.kv.v[:, :, end - 3 * tpf: end].clone())
        assert (d.kv.k.data_ptr(), d.kv.v.data_ptr()) == ptr


def test_recompute_matches_masked_forward(model, prompt):
    torch.manual_seed(5)
    h = BlockHistory()
    for b in range(2):
        h.append(HistoryBlock(b, torch.randn(SHAPE), None, 0.0, token=-1 - b))
    d = _denoiser(model, prompt, "recompute")
    d.sync(h)
    for block, hook in ((1, None), (2, None), (2, lambda hist: torch.full((1, 16, 1, 8, 8), 0.3))):
        d.first_frame_hook = hook
        noise = _noise(block, 1)
        res = d.denoise(block, noise, [625.0])
        assert res.forwards == 2 and d.kv.frames == list(range(6))
        if block == 1:
            ctx = h.blocks[0].x0
        else:
            first = hook(h) if hook else h.blocks[0].x0[:, :, :1]
            ctx = torch.cat([first, h.blocks[1].x0[:, :, 1:]], 2)
        t = torch.tensor([[0.0] * 3 + [625.0] * 3])
        v = model.forward_blockwise_masked(torch.cat([ctx, noise.initial], 2), t, d.cross, 3)[:, :, 3:]
        torch.testing.assert_close(res.x0, to_x0(noise.initial, v, SCHED.sigma_of(625.0)), atol=1e-5, rtol=1e-5)
    d.first_frame_hook = None
    res0 = d.denoise(0, _noise(0, 1), [625.0])  # block 0: no context
    assert res0.forwards == 1 and d.kv.frames == [0, 1, 2]
    with pytest.raises(ConfigError):
        d.denoise(3, _noise(3, 1), [625.0])  # history too short


def test_determinism(model, prompt):
    outs = []
    for _ in range(2):
        d = _denoiser(model, prompt, "global")
        _, res = _run(d, 2, seed=11)
        outs.append([r.x0 for r in res])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    d = _denoiser(model, prompt, "global")
    _, res = _run(d, 1, seed=12)
    assert not torch.equal(res[0].x0, outs[0][0])


def test_refine_on_reject(model, prompt):
    full = _denoiser(model, prompt, "global")
    ref = full.denoise(0, _noise(0), STEPS)
    d = _denoiser(model, prompt, "global")
    partial = d.denoise(0, _noise(0), STEPS[:2])  # x0 after step 1
    before = d.forwards
    res = d.denoise(0, _noise(0), STEPS, start_step=2, x0_init=partial.x0)
    assert res.forwards == 2 and d.forwards - before == 2
    assert torch.equal(res.x0, ref.x0)
    with pytest.raises(ConfigError):
        d.denoise(0, _noise(0), STEPS, start_step=2)
    with pytest.raises(ConfigError):
        d.denoise(0, _noise(0), STEPS, start_step=5, x0_init=partial.x0)
    # start_step = len(steps): nothing left to denoise, the block is x0_init (video-to-video at strength 0)
    kept = d.denoise(0, _noise(0), STEPS, start_step=4, x0_init=partial.x0)
    assert torch.equal(kept.x0, partial.x0) and kept.forwards == 0


def test_cancel_from_on_step(model, prompt):
    d = _denoiser(model, prompt, "global")
    seen = []

    def on_step(i, n):
        seen.append((i, n))
        if i == 1:
            raise CancelledError("stop")

    with pytest.raises(CancelledError):
        d.denoise(0, _noise(0), STEPS, on_step=on_step)
    assert seen == [(0, 4), (1, 4)] and d.forwards == 1


def test_no_growth_and_reuse(model, prompt):
    d = _denoiser(model, prompt, "global")
    ptr = (d.kv.k.data_ptr(), d.kv.v.data_ptr())
    h, _ = _run(d, 3)
    d.sync(h)
    assert (d.kv.k.data_ptr(), d.kv.v.data_ptr()) == ptr
    assert d.kv.nbytes == 2 * 2 * 12 * 16 * 2 * 16 * 4
    d.start(prompt, latent_shape=(8, 8), num_frames=12)  # same sizes: the cache is reused
    assert (d.kv.k.data_ptr(), d.kv.v.data_ptr()) == ptr and d.kv.frames == [] and d.forwards == 0
    r = _denoiser(model, prompt, "recompute")
    ptr = (r.kv.k.data_ptr(), r.kv.v.data_ptr())
    _run(r, 3)
    assert (r.kv.k.data_ptr(), r.kv.v.data_ptr()) == ptr and r.kv.capacity_frames == 6
    r.release()
    assert r.kv is None


def test_usage_errors(model, prompt):
    d = BlockDenoiser(model, CacheConfig(regime="global"), name="x")
    with pytest.raises(ConfigError):
        d.denoise(0, _noise(0), STEPS)
    d.start(prompt, latent_shape=(8, 8), num_frames=6)
    with pytest.raises(ConfigError):
        d.denoise(1, _noise(1), STEPS)  # block 0 not synced
    with pytest.raises(ConfigError):
        d.denoise(2, _noise(2), STEPS)  # beyond num_frames
    with pytest.raises(ConfigError):
        d.denoise(0, _noise(0, 2), STEPS)  # not enough re-noise tensors
    with pytest.raises(ConfigError):
        CacheConfig(regime="bogus")
    with pytest.raises(ConfigError):
        CacheConfig(regime="noisy", window_frames=4, sink_frames=3)
    with pytest.raises(ConfigError):
        d.start(prompt, latent_shape=(7, 8), num_frames=6)
    h = BlockHistory()
    with pytest.raises(ConfigError):
        h.append(HistoryBlock(1, torch.zeros(SHAPE), None, 0.0, 0))
