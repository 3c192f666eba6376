"""SDVG-hybrid: cascade scoring (a subset of the frames first) and step stitch on reject."""

from __future__ import annotations

import random

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.sampling.causal import BlockDenoiser
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import FrameScores, Router, RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler
from sdvg.sampling.scheduler import FlowMatchScheduler, build_step_schedule, sample_block_noise

PROMPT = "a red fox running through snow"


def test_cascade_never_accepts_what_full_scoring_rejects_and_equals_it_for_min():
    rng = random.Random(0)
    stopped = 0
    for trial in range(3000):
        n = rng.choice((9, 12))
        k = rng.randint(1, n - 1)
        scores = [rng.gauss(0.0, 1.0) for _ in range(n)]
        tau = rng.gauss(-1.0, 1.0)
        asked: list[list[int]] = []

        def score(idx, scores=scores, asked=asked):
            asked.append(list(idx))
            return torch.tensor([scores[i] for i in idx])

        full = Router(RouterConfig(tau=tau)).decide(1, scores)
        cascade = Router(RouterConfig(tau=tau, cascade=k)).decide(1, FrameScores(n, score))
        assert cascade.decision == full.decision, (trial, scores, tau, k)
        assert sorted(i for a in asked for i in a) == list(range(n)) or cascade.decision == "reject"
        assert len(asked[0]) == k and len(set(asked[0])) == k  # the subset is k distinct frames
        if len(asked) == 1:  # settled by the subset: a safe reject
            stopped += 1
            assert min(scores[i] for i in asked[0]) < tau and "cascade" in cascade.reason
        else:
            assert cascade.scores == pytest.approx(scores) and cascade.q == pytest.approx(full.q)
    assert 300 < stopped < 3000  # both branches are exercised


def test_cascade_subset_is_spread_and_settings_are_checked():
    assert Router(RouterConfig(cascade=4)).cascade_split(12) == ([0, 4, 7, 11], [1, 2, 3, 5, 6, 8, 9, 10])
    assert Router(RouterConfig(cascade=12)).cascade_split(12) is None  # nothing to save: score all at once
    for bad in ({"aggregation": "mean"}, {"threshold": "target-rate"}, {"early_exit": True}):
        with pytest.raises(ConfigError, match="ascade"):
            RouterConfig(cascade=4, **bad).validate()
    with pytest.raises(ConfigError, match="stitch needs refine_from_step"):
        SamplerConfig(stitch=True).validate()


def test_cascade_in_the_sampler_gives_the_full_scoring_video_with_fewer_frames_scored(tiny_models):
    class Frames:
        def __init__(self):
            self.scored = 0

        def call_started(self, call):
            if call.kind == "score":
                self.scored += call.signature[0]

        def call_finished(self, call):
            pass

    runs = {}
    for k in (0, 4):
        seen = Frames()
        sampler = SpeculativeSampler(tiny_models, RouterConfig(tau=-0.62, cascade=k),
                                     SamplerConfig(num_blocks=4, width=32, height=32))
        runs[k] = (sampler.run(PROMPT, observers=[seen]), seen.scored)
    (full, n_full), (casc, n_casc) = runs[0], runs[4]
    assert [b.decision for b in casc.blocks] == [b.decision for b in full.blocks]
    assert "reject" in [b.decision for b in full.blocks[1:]]
    assert torch.equal(casc.frames, full.frames)
    assert n_full == 36 and n_casc < n_full


def test_step_stitch_of_a_model_with_itself_is_its_own_full_run(tiny_models):
    """The stitched state at step k is exactly the drafter's input of step k: finishing it gives the full run."""
    steps = build_step_schedule("constant", 1, FlowMatchScheduler())[0]
    embeds = torch.randn(1, 8, tiny_models.drafter.config["text_dim"], generator=torch.Generator().manual_seed(0))
    den = BlockDenoiser(tiny_models.drafter, CacheConfig(regime="global"), name="drafter")
    noise = sample_block_noise(0, 0, (1, 16, 3, 4, 4), len(steps))
    den.start(embeds, latent_shape=(4, 4), num_frames=3)
    whole = den.denoise(0, noise, steps, keep_x0_step=1)
    stitched = den.denoise(0, noise, steps, start_step=2, x0_init=whole.x0_kept)
    refined = den.denoise(0, noise, steps, start_step=2, x0_init=whole.x0)
    assert torch.equal(stitched.x0, whole.x0) and stitched.forwards == 2
    assert not torch.equal(refined.x0, whole.x0)  # refine-on-reject re-noises the final x0: another state


def test_stitch_on_reject_runs_the_targets_last_steps_from_the_drafters_state(tiny_models):
    out = {}
    for stitch in (False, True):
        cfg = SamplerConfig(num_blocks=3, width=32, height=32, refine_from_step=2, stitch=stitch)
        out[stitch] = SpeculativeSampler(tiny_models, RouterConfig(tau=float("inf")), cfg).run(PROMPT)
    refine, stitch = out[False], out[True]
    assert [b.forwards["target"] for b in stitch.blocks[1:]] == [b.forwards["target"] for b in refine.blocks[1:]]
    assert torch.equal(stitch.frames[:9], refine.frames[:9]) and not torch.equal(stitch.frames, refine.frames)
    assert stitch.settings["stitch"] is True
