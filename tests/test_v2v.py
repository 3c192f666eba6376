"""Video-to-video on the tiny models: strength 1 is text-to-video, strength 0 is the input, in between is seeded."""

from __future__ import annotations

import math

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.sampling.conditioning_frames import InitBlocks, VideoToVideo
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPT = "a red fox running through snow"


def run(models, video=None, *, regime="noisy", blocks=2, init=None, **kw):
    config = SamplerConfig(num_blocks=blocks, width=16, height=16, cache=CacheConfig(regime), schedule="1000,500",
                           **kw)
    # τ = +inf: the drafter drafts every block and the target redoes it, both from the input
    return SpeculativeSampler(models, RouterConfig(mode="reward", tau=math.inf), config).run(PROMPT, video=video, init=init)


@pytest.fixture(scope="module")
def source(tiny_models):
    """A finished text-to-video run (the input video) and its frames encoded back by the streaming VAE."""
    t2v = run(tiny_models, seed=5)
    return t2v, t2v.frames


def test_encode_video_is_one_causal_stream(tiny_models, source):
    _, frames = source
    latents = tiny_models.vae.encode_video(frames)
    assert latents.shape == (1, 16, 6, 2, 2)
    assert torch.allclose(latents[:, :, :1], tiny_models.vae.encode_frame(frames[:1]), atol=1e-6)
    with pytest.raises(ConfigError, match="N = 1 \\+ 4k"):
        tiny_models.vae.encode_video(frames[:6])


def test_strength_one_is_text_to_video_and_zero_is_the_input(tiny_models, source):
    t2v, frames = source
    one = run(tiny_models, VideoToVideo.from_frames(tiny_models.vae, frames, 1.0, 2), seed=11)
    assert torch.equal(one.latents, run(tiny_models, seed=11).latents)
    video = VideoToVideo.from_frames(tiny_models.vae, frames, 0.0, 2)
    zero = run(tiny_models, video, seed=11)
    assert torch.equal(zero.latents, video.latents.to(zero.latents.dtype))
    assert [b.steps for b in zero.blocks] == [0, 0]


def test_partial_strength_is_seeded_and_runs_the_truncated_schedule(tiny_models, source):
    _, frames = source
    video = VideoToVideo.from_frames(tiny_models.vae, frames, 0.9, 2)  # steps [1000, 833.3] -> [833.3]
    a, b = run(tiny_models, video, seed=3), run(tiny_models, video, seed=3)
    assert torch.equal(a.latents, b.latents)
    assert [r.steps for r in a.blocks] == [1, 1]
    assert not torch.equal(a.latents, video.latents) and not torch.equal(a.latents, run(tiny_models, seed=3).latents)
    with pytest.raises(ConfigError, match="strength must be between 0 and 1"):
        VideoToVideo(video.latents, 1.5)
    with pytest.raises(ConfigError, match="covers 2 block"):
        run(tiny_models, video, blocks=3)


def test_cli_init_video(tiny_dir, tmp_path, capsys):
    import json

    from sdvg.cli.commands import main
    from sdvg.outputs import read_video_frames

    common = ["generate", "--prompt", PROMPT, "--models", str(tiny_dir), "--device", "cpu", "--blocks", "2",
              "--schedule", "1000,500"]
    base = [*common, "--width", "16", "--height", "16"]
    assert main([*base, "--out", str(tmp_path / "in.mp4")]) == 0
    report = tmp_path / "r.json"
    assert main([*base, "--v2v-video", str(tmp_path / "in.mp4"), "--strength", "0.9", "--out", str(tmp_path / "o.mp4"),
                 "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["settings"]["v2v_strength"] == 0.9 and [b["steps"] for b in data["blocks"]] == [1, 1]
    capsys.readouterr()
    assert main([*common, "--width", "32", "--height", "32", "--v2v-video", str(tmp_path / "in.mp4"),
                 "--strength", "0.5", "--out", str(tmp_path / "x.mp4")]) == 2
    assert "--v2v-video is 16×16 but the output is 32×32" in capsys.readouterr().err
    # extension: a finished 1-block video's latents come first; blocks 1.. are generated after them
    one = [*common[:7], "--blocks", "1", "--schedule", "1000,500", "--width", "16", "--height", "16"]
    assert main([*one, "--save-latents", str(tmp_path / "l.safetensors"), "--out", str(tmp_path / "one.mp4")]) == 0
    assert main([*base, "--init-latents", str(tmp_path / "l.safetensors"), "--report", str(report), "--out",
                 str(tmp_path / "ext.mp4")]) == 0
    blocks = json.loads(report.read_text())["blocks"]
    assert blocks[0]["produced_by"] == "input" and blocks[1]["drafted"]  # the given block anchors; block 1 is drafted
    assert len(read_video_frames(tmp_path / "ext.mp4")) == 21
    assert main([*base, "--init-image", str(tmp_path / "in.mp4"), "--out", str(tmp_path / "y.mp4")]) == 2
    assert "is not an image file" in capsys.readouterr().err


@pytest.mark.parametrize("regime", ["recompute", "global"])
def test_extension_from_a_finished_videos_latents_continues_it_exactly(tiny_models, regime):
    """A finished 4-block video, cut after block 1 and extended: the same 4 blocks, latents and frames (the caches
    are rebuilt from the same history, the VAE stream is primed by decoding the given blocks, block b's noise is
    (seed, b)'s). recompute re-encodes a decoded frame of the given blocks as its first context frame."""
    config = dict(num_blocks=4, width=16, height=16, cache=CacheConfig(regime), schedule="1000,500", seed=4)
    sampler = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), SamplerConfig(**config))
    finished = sampler.run(PROMPT)
    extended = sampler.run(PROMPT, init=InitBlocks(finished.latents[:, :, :6]))
    assert [b.produced_by for b in extended.blocks] == ["input", "input", "target", "target"]
    assert torch.equal(extended.latents, finished.latents) and torch.equal(extended.frames, finished.frames)


def test_image_to_video_holds_the_image_for_block_0_and_never_scores_it(tiny_models, source):
    _, frames = source
    init = InitBlocks.from_frames(tiny_models.vae, frames[:1])
    assert init.num_blocks == 1
    result = run(tiny_models, init=init, blocks=2)
    first, second = result.blocks
    assert (first.produced_by, first.decision, first.drafted, first.scores) == ("input", "input", False, [])
    assert second.drafted and second.scores  # the first generated block is drafted and scored (τ = +inf: rejected)
    assert result.settings["init_blocks"] == 1
    with pytest.raises(ConfigError, match="fill 1 block"):
        run(tiny_models, init=init, blocks=1)
