"""Invariants of the speculative sampler on the tiny models (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from sdvg.blocks import pixel_frames_for_blocks
from sdvg.errors import ConfigError
from sdvg.sampling.causal import BlockDenoiser
from sdvg.sampling.history import BlockHistory, HistoryBlock
from sdvg.sampling.regimes import CacheConfig, CacheRegime
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler
from sdvg.sampling.scheduler import sample_block_noise

PROMPT = "a red fox running through snow"
REGIMES = [CacheRegime.RECOMPUTE, CacheRegime.GLOBAL, CacheRegime.NOISY]


def run(models, *, mode="reward", tau=-0.7, regime=CacheRegime.RECOMPUTE, blocks=4, seed=0, first_frame="reencode",
        **kw):
    router_keys = ("random_rate", "force_reject_first", "aggregation", "threshold", "pattern", "score_drafts")
    router_kw = {k: kw.pop(k) for k in list(kw) if k in router_keys}
    router = RouterConfig(mode=mode, tau=tau, seed=seed, **router_kw)
    cache = CacheConfig(regime=regime, first_frame=first_frame)
    config = SamplerConfig(num_blocks=blocks, width=64, height=64, seed=seed, cache=cache, **kw)
    return SpeculativeSampler(models, router, config).run(PROMPT)


@pytest.mark.parametrize("regime", REGIMES, ids=lambda r: r.value)
def test_reject_all_is_bit_identical_to_target_only(tiny_models, regime):
    spec = run(tiny_models, tau=math.inf, regime=regime)
    ref = run(tiny_models, mode="target-only", regime=regime)
    assert [b.decision for b in spec.blocks] == ["reject"] * 4
    assert all(b.produced_by == "target" for b in spec.blocks)
    assert [b.drafted for b in spec.blocks] == [False, True, True, True]
    assert torch.equal(spec.latents, ref.latents)
    assert torch.equal(spec.frames, ref.frames), "decoded frames differ: the VAE restore is not exact"
    assert spec.frames.shape == (pixel_frames_for_blocks(4), 64, 64, 3)


def test_accept_all_equals_drafter_conditioned_on_target_block0(tiny_models):
    spec = run(tiny_models, tau=-math.inf, first_frame="latent")
    ref = run(tiny_models, mode="target-only", first_frame="latent")
    assert [b.produced_by for b in spec.blocks] == ["target", "drafter", "drafter", "drafter"]
    assert torch.equal(spec.latents[:, :, :3], ref.latents[:, :, :3])
    # Independent composition through the low-level API: the drafter continues from the target's block 0.
    drafter = BlockDenoiser(tiny_models.drafter, CacheConfig(), name="drafter")
    drafter.start(tiny_models.text_encoder.encode(PROMPT), latent_shape=(8, 8), num_frames=12)
    history = BlockHistory()
    b0 = ref.latents[:, :, :3]
    history.append(HistoryBlock(index=0, x0=b0, last_noisy=b0, last_t=0.0, token=-1))
    from sdvg.sampling.scheduler import FlowMatchScheduler, build_step_schedule

    steps = build_step_schedule("constant", 4, FlowMatchScheduler())
    for b in range(1, 4):
        drafter.sync(history)
        noise = sample_block_noise(0, b, (1, 16, 3, 8, 8), len(steps[b]), device="cpu", dtype=torch.float32)
        res = drafter.denoise(b, noise, steps[b])
        history.append(HistoryBlock(index=b, x0=res.x0, last_noisy=res.last_noisy, last_t=res.last_t, token=res.token))
    assert torch.equal(spec.latents, history.latents())


def test_same_seed_same_video_other_seed_other_video(tiny_models):
    a = run(tiny_models, mode="random", random_rate=0.5, seed=3)
    b = run(tiny_models, mode="random", random_rate=0.5, seed=3)
    c = run(tiny_models, mode="random", random_rate=0.5, seed=4)
    assert torch.equal(a.frames, b.frames) and torch.equal(a.latents, b.latents)
    assert [r.decision for r in a.blocks] == [r.decision for r in b.blocks]
    assert not torch.equal(a.latents, c.latents)


def test_random_routing_rate_and_determinism(tiny_models):
    res = run(tiny_models, mode="random", random_rate=0.5, blocks=16, seed=11)
    drafted = [b for b in res.blocks if b.drafted]
    assert len(drafted) == 15
    rate = sum(b.decision == "accept" for b in drafted) / len(drafted)
    assert 0.15 <= rate <= 0.85
    assert res.totals["acceptance"] == pytest.approx(rate)
    again = run(tiny_models, mode="random", random_rate=0.5, blocks=16, seed=11)
    assert [b.decision for b in again.blocks] == [b.decision for b in res.blocks]
    assert all(b.scores == [] for b in drafted), "random routing must not run the reward model"


@pytest.mark.parametrize("regime", REGIMES, ids=lambda r: r.value)
def test_pipelined_verification_gives_the_same_video(tiny_models, regime):
    plain = run(tiny_models, mode="random", random_rate=0.5, blocks=6, seed=1, regime=regime)
    piped = run(tiny_models, mode="random", random_rate=0.5, blocks=6, seed=1, regime=regime, pipelined=True)
    assert [b.decision for b in piped.blocks] == [b.decision for b in plain.blocks]
    assert {"accept", "reject"} <= {b.decision for b in plain.blocks if b.drafted}
    assert torch.equal(piped.latents, plain.latents)
    assert torch.equal(piped.frames, plain.frames)


def test_diagonal_schedule_and_noisy_cache_forward_counts(tiny_models):
    res = run(tiny_models, mode="target-only", regime=CacheRegime.NOISY, schedule="diagonal", blocks=5)
    assert [b.steps for b in res.blocks] == [4, 3, 2, 2, 2]
    # Noisy cache: no clean pass, so the target runs exactly one forward per denoising step.
    assert [b.forwards["target"] for b in res.blocks] == [4, 3, 2, 2, 2]
    glob = run(tiny_models, mode="target-only", regime=CacheRegime.GLOBAL, schedule="diagonal", blocks=5)
    # Global cache: one deferred clean pass per finished block, run when the next block starts.
    assert [b.forwards["target"] for b in glob.blocks] == [4, 4, 3, 3, 3]


def test_a_diagonal_1_drafter_takes_one_step_a_drafted_block(tiny_models):
    """SDVG with a drafter on "diagonal-1": block 0 is the target's on its own schedule, every drafted block takes one
    step; draft-only draws block 0 on the diagonal's first list (4 steps)."""
    from dataclasses import replace

    cfg = replace(SamplerConfig(num_blocks=4, width=64, height=64), drafter_schedule="diagonal-1").validate()
    res = SpeculativeSampler(tiny_models, RouterConfig(mode="random", random_rate=1.0), cfg).run(PROMPT)
    assert [b.produced_by for b in res.blocks] == ["target", "drafter", "drafter", "drafter"]
    assert [b.steps for b in res.blocks] == [4, 1, 1, 1]
    draft_only = SpeculativeSampler(tiny_models, RouterConfig(mode="draft-only"), cfg).run(PROMPT)
    assert [b.steps for b in draft_only.blocks] == [4, 1, 1, 1]


def test_refine_on_reject_runs_only_the_remaining_steps(tiny_models):
    res = run(tiny_models, tau=math.inf, regime=CacheRegime.NOISY, refine_from_step=2)
    for rec in res.blocks[1:]:
        assert rec.forwards["target"] == 2  # steps 2..3 only; its own previous block is already in its cache
        assert rec.forwards["drafter"] == 4 + 1  # 4 draft steps + writing the target's previous block


def test_cancel_stops_within_one_step_and_keeps_finished_blocks(tiny_models):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 10  # block 0 (4 target steps) + block 1 draft (4) + part of block 2

    router = RouterConfig(mode="random", random_rate=1.0)
    sampler = SpeculativeSampler(tiny_models, router, SamplerConfig(num_blocks=5, width=64, height=64))
    steps_seen = []
    result = sampler.run(PROMPT, cancel=cancel, on_step=lambda ev: steps_seen.append((ev.block, ev.step)))
    assert result.partial
    assert len(result.blocks) == 2
    assert result.frames.shape[0] == 9 + 12
    assert len(steps_seen) == 10, "no model call may run after the cancel callback said stop"
    assert result.latents.shape[2] == 6


def test_report_fields(tiny_models):
    res = run(tiny_models, tau=0.0)
    rep = res.report()
    assert rep["settings"]["cache"] == "recompute" and rep["partial"] is False
    for block in rep["blocks"]:
        assert {"block", "decision", "reason", "q", "scores", "tau", "produced_by", "steps", "timings"} <= set(block)
    drafted = [b for b in rep["blocks"] if b["drafted"]]
    assert all(len(b["scores"]) == 12 and b["q"] == min(b["scores"]) for b in drafted)
    assert rep["totals"]["est_target_only_s"] > 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"width": 60}, "multiples of 16"),
        ({"height": 0}, "multiples of 16"),
        ({"num_blocks": 0}, "at least 1"),
        ({"refine_from_step": 0}, "refine_from_step"),
    ],
)
def test_bad_settings_are_refused_clearly(tiny_models, kw, match):
    base = {"num_blocks": 2, "width": 64, "height": 64}
    base.update(kw)
    with pytest.raises(ConfigError, match=match):
        SpeculativeSampler(tiny_models, RouterConfig(), SamplerConfig(**base))


def test_nan_tau_is_refused(tiny_models):
    with pytest.raises(ConfigError):
        SpeculativeSampler(tiny_models, RouterConfig(tau=float("nan")), SamplerConfig(num_blocks=2, width=64, height=64))


@pytest.mark.parametrize("pipelined", [False, True])
def test_recompute_context_reencodes_the_oldest_of_the_last_9_pixel_frames(tiny_models, pipelined, monkeypatch):
    """Krea's recompute: from block 2 on, the first context frame is pixel frame 12·b − 12 re-encoded as an image,
    computed once per block and shared by the drafter and the target."""
    vae = tiny_models.vae
    seen = []
    original = vae.encode_frame

    def spy(image):
        seen.append(image.clone())
        return original(image)

    monkeypatch.setattr(vae, "encode_frame", spy)
    res = run(tiny_models, mode="random", random_rate=0.5, blocks=6, seed=1, pipelined=pipelined)
    assert {"accept", "reject"} <= {b.decision for b in res.blocks if b.drafted}
    for block in range(2, 6):  # once per block although both models refill their caches
        wanted = res.frames[12 * block - 12 : 12 * block - 11]
        assert sum(torch.equal(image, wanted) for image in seen) == 1
    # Pipelining may also encode a frame of a speculative draft that is then rejected (wasted, like the draft).
    wasted = sum(b.decision == "reject" for b in res.blocks[1:4]) if pipelined else 0
    assert len(seen) == 4 + wasted
    latent = run(tiny_models, mode="random", random_rate=0.5, blocks=6, seed=1, first_frame="latent")
    assert not torch.equal(latent.latents[:, :, 6:], res.latents[:, :, 6:])
    assert torch.equal(latent.latents[:, :, :6], res.latents[:, :, :6])


def test_target_only_estimate_prices_forwards_decodes_and_reencodes_apart():
    """The report's estimated target-only time: (steps + refill) forwards per block at the mean target forward time,
    one decode per block, and one first-frame re-encode per block from block 2 on (recompute regime), each priced
    by its own measured mean — the encode time is not folded into the forwards."""
    from sdvg.sampling.meter import estimate_totals
    from sdvg.sampling.results import BlockRecord

    records = [BlockRecord(block=b, decision="accept", reason="", produced_by="target", steps=4,
                           timings={"decode": 0.1}) for b in range(4)]
    stats = {"target": {"seconds": 1.9, "calls": 19}, "encode": {"seconds": 0.4, "calls": 2}}
    totals = estimate_totals(records, 3.0, stats, CacheConfig("recompute", first_frame="reencode").policy(), 4)
    # 4 + 3 × (4 + 1) = 19 forwards × 0.1 s, 4 decodes × 0.1 s, 2 encodes × 0.2 s
    assert totals["est_target_only_s"] == pytest.approx(1.9 + 0.4 + 0.4)
    assert totals["forward_s"] == {"target": pytest.approx(0.1), "encode": pytest.approx(0.2)}
    latent = CacheConfig("recompute", first_frame="latent").policy()
    assert estimate_totals(records, 3.0, stats, latent, 4)["est_target_only_s"] == pytest.approx(1.9 + 0.4)
    # drafted blocks on the drafter's own one-step schedule are priced at the target's steps, not their own
    drafts = [records[0], *(BlockRecord(block=b, decision="accept", reason="", produced_by="drafter", steps=1,
                                        drafted=True, timings={"decode": 0.1}) for b in range(1, 4))]
    assert estimate_totals(drafts, 3.0, stats, latent, 4, [4, 4, 4, 4])["est_target_only_s"] == pytest.approx(1.9 + 0.4)
    assert estimate_totals(drafts, 3.0, stats, latent, 4)["est_target_only_s"] == pytest.approx(1.9 - 0.9 + 0.4)


def test_reencodes_are_timed_apart_from_the_target_forwards(tiny_models):
    res = run(tiny_models, mode="target-only")
    fs, target_phase = res.totals["forward_s"], res.totals["phase_s"]["target"]
    # the target phase (timed around each denoise) splits exactly into 19 forwards and the 2 re-encodes inside them
    # (blocks 2 and 3), up to the few microseconds between the two clocks
    assert 19 * fs["target"] + 2 * fs["encode"] == pytest.approx(target_phase, abs=2e-3)
    assert fs["encode"] > 0 and fs["target"] > 0


@pytest.mark.parametrize("regime", REGIMES, ids=lambda r: r.value)
def test_pattern_routing_realizes_the_pattern_and_scores_only_when_asked(tiny_models, regime):
    pattern = (True, False, True)
    res = run(tiny_models, mode="pattern", blocks=4, regime=regime, pattern=pattern)
    assert [b.decision == "accept" for b in res.blocks[1:]] == list(pattern)
    assert all(b.scores == [] for b in res.blocks)
    scored = run(tiny_models, mode="pattern", blocks=4, regime=regime, pattern=pattern, score_drafts=True)
    assert [b.decision for b in scored.blocks] == [b.decision for b in res.blocks]
    assert all(len(b.scores) == 12 and b.q == min(b.scores) for b in scored.blocks[1:])
    assert torch.equal(scored.latents, res.latents) and torch.equal(scored.frames, res.frames)


def test_a_drafter_schedule_of_its_own_leaves_the_target_bit_identical(tiny_models):
    """A distilled drafter on its own schedule and step noise (drafter_schedule, drafter_step_noise) beside the
    target's: drafts take the drafter's steps, the target's blocks are exactly a target-only run's (the block noise
    is shared by prefix), reject-all included."""
    kw = {"drafter_schedule": "diagonal", "drafter_step_noise": "predicted", "regime": CacheRegime.NOISY}
    ref = run(tiny_models, mode="target-only", regime=CacheRegime.NOISY)
    spec = run(tiny_models, tau=math.inf, **kw)
    assert torch.equal(spec.latents, ref.latents)
    drafts = run(tiny_models, mode="draft-only", **kw)
    assert [b.steps for b in drafts.blocks] == [4, 3, 2, 2]
    assert [b.steps for b in spec.blocks] == [4, 4, 4, 4]
    assert not torch.equal(drafts.latents, run(tiny_models, mode="draft-only", regime=CacheRegime.NOISY).latents)
    with pytest.raises(ConfigError, match="refine_from_step continues a draft"):
        SamplerConfig(num_blocks=2, width=64, height=64, drafter_schedule="diagonal", refine_from_step=1).validate()
    with pytest.raises(ConfigError, match="drafter_step_noise must be one of"):
        SamplerConfig(num_blocks=2, width=64, height=64, drafter_step_noise="stale").validate()


def test_score_frames_scores_only_the_subset_and_the_worst_of_it_decides(tiny_models):
    class Scores:
        def __init__(self):
            self.frames = []

        def call_started(self, call):
            pass

        def call_finished(self, call):
            if call.kind == "score":
                self.frames.append(call.signature[0])

    cfg = SamplerConfig(num_blocks=3, width=64, height=64)
    full, sub = Scores(), Scores()
    a = SpeculativeSampler(tiny_models, RouterConfig(tau=-math.inf), cfg).run(PROMPT, observers=(full,))
    b = SpeculativeSampler(tiny_models, RouterConfig(tau=-math.inf, score_frames=2), cfg).run(PROMPT, observers=(sub,))
    assert full.frames == [12, 12] and sub.frames == [2, 2]  # blocks 1 and 2 (12 frames each), block 0 the target's
    for ra, rb in zip(a.blocks[1:], b.blocks[1:], strict=True):
        # the same draft (same noise, all accepted): the subset's scores are the full scores' first and last frame
        assert rb.scores == pytest.approx([ra.scores[0], ra.scores[-1]], abs=1e-5)
        assert rb.q == pytest.approx(min(rb.scores), abs=1e-6)
