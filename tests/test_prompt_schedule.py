"""A prompt timeline on the tiny models: switches re-initialise the cross-attention once, leave the video before
them untouched, score against the prompt in force and re-anchor the relative τ."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sdvg.blocks import pixel_frames_for_blocks
from sdvg.errors import ConfigError
from sdvg.sampling.prompt_schedule import PromptSchedule
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

A, B, C = "a red fox running through snow", "the fox jumps over a frozen river", "an owl flies over the trees"
TIMELINE = f"0:{A}|2:{B}|4:{C}"


class Setups:
    def __init__(self):
        self.n = 0

    def call_started(self, call):
        self.n += call.kind == "setup"

    def call_finished(self, call):
        pass


def run(models, prompt, *, mode="target-only", regime="recompute", tau=-0.7, threshold="fixed", observers=(),
        blocks=6):
    config = SamplerConfig(num_blocks=blocks, width=16, height=16, cache=CacheConfig(regime), schedule="1000,500")
    router = RouterConfig(mode=mode, tau=tau, threshold=threshold, delta=0.05)
    return SpeculativeSampler(models, router, config).run(prompt, observers=observers)


def test_parse_and_refuse():
    s = PromptSchedule.parse(TIMELINE, blend_blocks=1)
    assert s.switches == [2, 4] and s.prompt_at(3) == B and s.prompt_at(5) == C
    assert [s.conditioning_key(b) for b in range(6)] == [(0, 0), (0, 0), (1, 1), (1, 0), (2, 1), (2, 0)]
    assert PromptSchedule.from_json({"0": A, "3": B}).switches == [3]
    for bad, match in [("2:late start", "start at block 0"), (f"0:{A}|0:{B}", "must increase"),
                       ("fox", "BLOCK:prompt"), ("0:  ", "empty")]:
        with pytest.raises(ConfigError, match=match):
            PromptSchedule.parse(bad)
    with pytest.raises(ConfigError, match="block 9 but the video has 6"):
        PromptSchedule.parse(f"0:{A}|9:{B}").check_blocks(6)


@pytest.mark.parametrize("mode, regime, models_switching", [("target-only", "recompute", 1), ("reward", "noisy", 2)])
def test_switch_reinitialises_cross_attention_once_and_keeps_the_past(tiny_models, mode, regime, models_switching):
    """τ = +inf in reward mode: both models run every block (the drafter drafts, the target redoes it), and the
    noisy caches write each other's blocks under the prompt those were made with."""
    tau = math.inf if mode == "reward" else -0.7
    plain = run(tiny_models, A, mode=mode, regime=regime, tau=tau)
    setups = Setups()
    timed = run(tiny_models, PromptSchedule.parse(TIMELINE), mode=mode, regime=regime, tau=tau, observers=[setups])
    assert setups.n == 2 + 2 * models_switching  # one setup per model at the start, then one per switch and model
    n = pixel_frames_for_blocks(2)
    assert torch.equal(timed.frames[:n], plain.frames[:n])  # the video before the first switch is untouched
    assert torch.equal(timed.latents[:, :, :6], plain.latents[:, :, :6])
    assert not torch.equal(timed.latents[:, :, 6:9], plain.latents[:, :, 6:9])
    assert [b.prompt for b in timed.blocks] == [None, None, B, None, C, None]
    assert timed.settings["prompt_schedule"]["segments"][1] == {"block": 2, "prompt": B}


def test_blocks_are_scored_against_the_prompt_in_force(tiny_models):
    result = run(tiny_models, PromptSchedule.parse(TIMELINE), mode="reward", tau=-math.inf, blocks=5)
    frames = result.frames[pixel_frames_for_blocks(3):pixel_frames_for_blocks(4)]  # block 3, under prompt B
    assert result.blocks[3].scores == pytest.approx(tiny_models.reward.score(frames, B).tolist(), abs=1e-6)
    assert result.blocks[3].scores != pytest.approx(tiny_models.reward.score(frames, A).tolist(), abs=1e-6)


def test_relative_threshold_reanchors_on_the_first_block_after_a_switch(tiny_models):
    result = run(tiny_models, PromptSchedule.parse(TIMELINE), mode="reward", threshold="relative", blocks=5)
    forced = [b.block for b in result.blocks if not b.drafted]
    assert forced == [0, 2, 4]
    assert "reference" in result.blocks[2].reason and result.blocks[2].produced_by == "target"


def test_pipelined_timeline_equals_plain(tiny_models):
    config = dict(num_blocks=5, width=16, height=16, cache=CacheConfig("noisy"), schedule="1000,500")
    router = RouterConfig(mode="reward", tau=math.inf)
    plain = SpeculativeSampler(tiny_models, router, SamplerConfig(**config)).run(PromptSchedule.parse(TIMELINE))
    piped = SpeculativeSampler(tiny_models, router, SamplerConfig(pipelined=True, **config)).run(
        PromptSchedule.parse(TIMELINE))
    assert torch.equal(piped.latents, plain.latents) and torch.equal(piped.frames, plain.frames)


def test_cli_prompt_schedule_marks_the_switch(tiny_dir, tmp_path, capsys):
    from sdvg.cli.commands import main

    report, timeline = tmp_path / "r.json", tmp_path / "t.png"
    args = ["generate", "--prompt-schedule", f"0:{A}|2:{B}", "--models", str(tiny_dir), "--device", "cpu",
            "--blocks", "3", "--width", "16", "--height", "16", "--mode", "target-only", "--out",
            str(tmp_path / "v.mp4"), "--report", str(report), "--timeline", str(timeline)]
    assert main(args) == 0
    data = json.loads(report.read_text())
    assert [b["prompt"] for b in data["blocks"]] == [None, None, B]
    assert data["settings"]["prompt"] == A and timeline.stat().st_size > 1000
    assert f"prompt from block 2: {B}" in capsys.readouterr().out
    assert main([*args[:2], f"0:{A}|5:{B}", *args[3:]]) == 2  # a switch past the video: refused before loading
    assert "block 5 but the video has 3" in capsys.readouterr().err


def test_a_blend_sets_up_each_step_once_and_ends_on_the_new_prompt(tiny_models):
    setups = Setups()
    blended = run(tiny_models, PromptSchedule.parse(f"0:{A}|2:{B}", blend_blocks=2), observers=[setups], blocks=5)
    assert setups.n == 2 + 3  # the start (both models), then the target's two blend steps and the new prompt
    sharp = run(tiny_models, PromptSchedule.parse(f"0:{A}|2:{B}"), blocks=5)
    assert torch.equal(blended.latents[:, :, :6], sharp.latents[:, :, :6])
    assert not torch.equal(blended.latents[:, :, 6:9], sharp.latents[:, :, 6:9])  # block 2: a third of the way to B
