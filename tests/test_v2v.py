"""Video-to-video on the tiny models: strength 1 is text-to-video, strength 0 is the input, in between is seeded."""

from __future__ import annotations

import math

import pytest
import torch

from sdvg.conditioning_frames import VideoToVideo
from sdvg.errors import ConfigError
from sdvg.regimes import CacheConfig
from sdvg.router import RouterConfig
from sdvg.sampler import SamplerConfig, SpeculativeSampler

PROMPT = "a red fox running through snow"


def run(models, video=None, *, regime="noisy", blocks=2, **kw):
    config = SamplerConfig(num_blocks=blocks, width=16, height=16, cache=CacheConfig(regime), schedule="1000,500",
                           **kw)
    # τ = +inf: the drafter drafts every block and the target redoes it, both from the input
    return SpeculativeSampler(models, RouterConfig(mode="reward", tau=math.inf), config).run(PROMPT, video=video)


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

    from sdvg.cli import main

    common = ["generate", "--prompt", PROMPT, "--models", str(tiny_dir), "--device", "cpu", "--blocks", "2",
              "--schedule", "1000,500"]
    base = [*common, "--width", "16", "--height", "16"]
    assert main([*base, "--out", str(tmp_path / "in.mp4")]) == 0
    report = tmp_path / "r.json"
    assert main([*base, "--init-video", str(tmp_path / "in.mp4"), "--strength", "0.9", "--out", str(tmp_path / "o.mp4"),
                 "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["settings"]["v2v_strength"] == 0.9 and [b["steps"] for b in data["blocks"]] == [1, 1]
    capsys.readouterr()
    assert main([*common, "--width", "32", "--height", "32", "--init-video", str(tmp_path / "in.mp4"),
                 "--strength", "0.5", "--out", str(tmp_path / "x.mp4")]) == 2
    assert "--init-video is 16×16 but the output is 32×32" in capsys.readouterr().err
