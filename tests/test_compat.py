"""The compatibility switches (``sdvg/compat.py``): each does what it says, and the profiles pick them all."""

from __future__ import annotations

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.loaders.checkpoint import unwrap_state_dict
from sdvg.loaders.vae import load_streaming_vae
from sdvg.sampling.causal import BlockDenoiser
from sdvg.sampling.compat import PROFILES, Compat, profile
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import Router, RouterConfig, quantile
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler
from sdvg.sampling.scheduler import FlowMatchScheduler, build_step_schedule, renoise, sample_block_noise, to_x0
from tests.inputs import latents as _lat

PROMPT = "a red fox running through snow"


def _run(models, compat=Compat(), *, blocks=3, tau=-0.7, router=None, sampler=None):
    sampler = sampler or SpeculativeSampler(models, router or RouterConfig(tau=tau),
                                            SamplerConfig(num_blocks=blocks, width=32, height=32, compat=compat))
    return sampler.run(PROMPT)


def test_profiles_and_single_switches():
    ref = PROFILES["reference"]
    assert PROFILES["sdvg"] == Compat() and Compat().differences() == []
    assert set(ref.differences()) == {"t0_tail_step", "vae_decoder", "block0_frames", "pt_weights", "threshold_state",
                                      "reward_preprocess"}
    one = profile("sdvg", vae_decoder="krea")
    assert one.differences() == ["vae_decoder"]
    assert profile("reference", block0_frames=9).differences() == sorted(set(ref.differences()) - {"block0_frames"},
                                                                         key=ref.differences().index)
    with pytest.raises(ConfigError, match="block0_frames"):
        Compat(block0_frames=7)
    with pytest.raises(ConfigError, match="Unknown compatibility profile"):
        profile("krea")


# ---- 1. Krea's t = 0 tail step -------------------------------------------------------------------------------

def test_tail_schedule_is_kreas_five_steps():
    sch = FlowMatchScheduler()
    krea = build_step_schedule("1000,750,500,250,0", 2, sch)  # Krea's get_denoising_schedule(5 steps)
    assert krea[0] == [1000.0, 937.5, sch.snap(833.3333333), 625.0, 0.0]
    assert SamplerConfig(num_blocks=2, compat=Compat(t0_tail_step=True)).step_schedule() == krea
    assert sch.step_sigma(0.0) == sch.sigmas[-1].item() and 0.0049 < sch.step_sigma(0.0) < 0.0050
    assert sch.sigma_of(0.0) == 0.0  # plain lookups are unchanged
    with pytest.raises(ConfigError, match="only the last"):
        build_step_schedule([[1000.0, 0.0, 500.0]], 1, sch)


def test_tail_step_renoises_to_the_smallest_sigma_and_calls_the_model_at_t0(tiny_models):
    """The 5-step result is the 4-step x0 re-noised to σ_min with ε_4, one call at t = 0, x0 = x − σ_min·v."""
    sch = FlowMatchScheduler()
    four = build_step_schedule("constant", 1, sch)[0]
    embeds = torch.randn(1, 8, tiny_models.drafter.config["text_dim"], generator=torch.Generator().manual_seed(0))
    den = BlockDenoiser(tiny_models.drafter, CacheConfig(regime="global"), name="drafter")
    noise = sample_block_noise(0, 0, (1, 16, 3, 4, 4), 5)
    results = {}
    for steps in (four, [*four, 0.0]):
        den.start(embeds, latent_shape=(4, 4), num_frames=3)
        results[len(steps)] = den.denoise(0, noise, steps)
    a, b = results[4], results[5]
    s_min = sch.sigmas[-1].item()
    assert torch.equal(b.last_noisy, renoise(a.x0, noise.renoise[3], s_min))
    v = den.call(b.last_noisy, 0.0, 0)  # global regime: the call overwrites the same slots, so it repeats exactly
    assert torch.equal(b.x0, to_x0(b.last_noisy, v, s_min))
    rel = ((b.x0 - a.x0).norm() / a.x0.norm()).item()
    assert 0 < rel < 0.05  # a near no-op, not a no-op


# ---- 2. Krea's streaming decoder -------------------------------------------------------------------------------

def test_krea_decoder_differs_from_ours_exactly_from_pixel_frame_9(tiny_vae_path):
    vae = load_streaming_vae(tiny_vae_path, device="cpu", dtype="fp32")
    blocks = [_lat(i) for i in range(3)]
    out = {}
    for variant in ("wan", "krea"):
        vae.reset(decoder=variant)
        out[variant] = torch.cat([vae.decode_block(b) for b in blocks])
    wan, krea = out["wan"], out["krea"]
    assert wan.shape == krea.shape == (33, 16, 16, 3)
    assert torch.equal(wan[:9], krea[:9])
    per_frame = (wan - krea).abs().flatten(1).amax(1)
    assert (per_frame[9:] > 0).all()
    # a draft decoded and rejected leaves Krea's stream where it was, too
    vae.reset(decoder="krea")
    vae.decode_block(blocks[0])
    snap = vae.snapshot()
    vae.decode_block(blocks[2])
    vae.restore(snap)
    assert torch.equal(vae.decode_block(blocks[1]), krea[9:21])
    with pytest.raises(ConfigError, match="decoder variant"):
        vae.reset(decoder="taehv")


# ---- 3. block 0 shown as 6 frames ----------------------------------------------------------------------------

def test_block0_six_frames_drops_the_first_three_and_keeps_them_as_context(tiny_models):
    ours = _run(tiny_models, blocks=2)
    events = []
    sampler = SpeculativeSampler(tiny_models, RouterConfig(), SamplerConfig(
        num_blocks=2, width=32, height=32, compat=Compat(block0_frames=6)))
    six = sampler.run(PROMPT, on_block=events.append)
    assert ours.frames.shape[0] == 21 and six.frames.shape[0] == 18
    assert torch.equal(six.frames, ours.frames[3:])  # the same video (the context saw all 9 frames), 3 not shown
    assert [e.frames.shape[0] for e in events] == [6, 12]
    with pytest.raises(ConfigError, match="30 frames"):
        SamplerConfig(num_blocks=3, num_frames=31, compat=Compat(block0_frames=6)).validate()


# ---- 4. which weights of a training .pt -------------------------------------------------------------------------

def test_pt_weights_picks_generator_or_ema(tiny_dir):
    from sdvg.loaders.wan import load_dit

    sd = {"w": torch.zeros(2)}
    obj = {"generator": sd, "generator_ema": {"w": torch.ones(2)}}
    assert unwrap_state_dict(obj, tiny_dir).entry == "generator_ema"
    assert unwrap_state_dict(obj, tiny_dir, pt_weights="generator").entry == "generator"
    path = next((tiny_dir / "diffusion_models").glob("*.pt"))
    raw = torch.load(path, weights_only=True)
    assert not torch.equal(raw["generator"]["model.head.head.weight"], raw["generator_ema"]["model.head.head.weight"])
    for which, entry in (("ema", "generator_ema"), ("generator", "generator")):
        dit = load_dit(path, dtype="fp32", device="cpu", pt_weights=which)
        assert torch.equal(dit.proj_out.weight, raw[entry]["model.head.head.weight"])


# ---- 5. target-rate statistics per video or pooled -------------------------------------------------------------

def test_pooled_threshold_state_carries_scores_across_videos(tiny_models):
    router = RouterConfig(threshold="target-rate", prior_count=1)
    taus = {}
    for state in ("per-video", "pooled"):
        sampler = SpeculativeSampler(tiny_models, router, SamplerConfig(
            num_blocks=2, width=32, height=32, compat=Compat(threshold_state=state)))
        first, second = _run(tiny_models, sampler=sampler), _run(tiny_models, sampler=sampler)
        taus[state] = ([b.tau for b in first.blocks[1:]], [b.tau for b in second.blocks[1:]])
        if state == "pooled":
            pooled_q = [b.q for b in first.blocks[1:]]
            assert second.blocks[1].tau == pytest.approx(quantile(pooled_q, 1 - Router(
                RouterConfig(threshold="target-rate", num_blocks=2)).effective_rate()))
    assert taus["per-video"][0] == taus["per-video"][1]  # every video starts from the prior
    assert taus["pooled"][0] == taus["per-video"][0] and taus["pooled"][1] != taus["per-video"][1]


# ---- 6. ImageReward preprocessing ------------------------------------------------------------------------------

def test_pil_preprocessing_truncates_to_uint8_and_resizes_with_pil(tiny_reward):
    import numpy as np
    from PIL import Image

    s = tiny_reward.config.image_size
    flat = torch.full((1, s, s, 3), 0.5)  # 127.5: truncated to 127 (torchvision's to_pil_image), not rounded to 128
    mean, std = torch.tensor((0.48145466, 0.4578275, 0.40821073)), torch.tensor((0.26862954, 0.26130258, 0.27577711))
    got = tiny_reward.preprocess(flat, "pil")[0, :, 0, 0]
    torch.testing.assert_close(got, (127 / 255 - mean) / std)
    frames = torch.rand(2, 48, 80, 3, generator=torch.Generator().manual_seed(1))
    pil = tiny_reward.preprocess(frames, "pil")
    u8 = (frames * 255).to(torch.uint8).numpy()
    want = np.stack([np.asarray(Image.fromarray(f).resize((int(s * 80 / 48), s), Image.BICUBIC)) for f in u8])
    left = int(round((int(s * 80 / 48) - s) / 2))
    want = torch.from_numpy(want).permute(0, 3, 1, 2).float()[..., left:left + s] / 255
    torch.testing.assert_close(pil, (want - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1))
    ours = tiny_reward.preprocess(frames)
    assert 0 < (pil - ours).abs().mean() < 0.05
    a = tiny_reward.score(frames, PROMPT)
    b = tiny_reward.score(frames, PROMPT, preprocess="pil")
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05)


def test_reference_profile_runs_end_to_end(tiny_models):
    result = _run(tiny_models, PROFILES["reference"])
    assert result.frames.shape[0] == 30 and result.settings["compat"] == PROFILES["reference"].to_dict()
    assert result.settings["schedule"][0][-1] == 0.0 and all(r.steps == 5 for r in result.blocks)
