"""A finished block is never lost: faults in every phase of a run (injected through the engine's own call hooks, or a
real model producing NaN), bad settings refused before anything loads, outputs checked up front and written
atomically. (SIGINT/SIGTERM: tests/test_cli.py.)"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from sdvg.cli.commands import main
from sdvg.errors import ConfigError, RunFailed
from sdvg.loaders.bundle import SDVGModels
from sdvg.sampling.regimes import CacheConfig
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPT = "a red fox running through snow"


def config(**kw) -> SamplerConfig:
    return SamplerConfig(**{"num_blocks": 4, "width": 64, "height": 64, **kw})


class FailAt:
    """A call observer that raises when the n-th call of ``kind`` starts: a fault inside that model call."""

    def __init__(self, kind: str, nth: int, exc: Exception):
        self.kind, self.nth, self.exc, self.seen = kind, nth, exc, 0

    def call_started(self, call):
        if call.kind == self.kind:
            self.seen += 1
            if self.seen == self.nth:
                raise self.exc

    def call_finished(self, call):
        pass


def nan_copy(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.proj_out.bias.fill_(math.nan)
    return broken


# ---- faults inside a run ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "nth", "stage", "finished"),
    [
        ("target", 6, "the target", 1),  # block 0: 4 steps; block 1 rejected: the refill, then its 1st step fails
        ("decode", 3, "the VAE decoder", 1),  # block 0's decode, block 1's draft, block 1's target block
        ("score", 2, "the reward model (ImageReward)", 2),
        ("drafter", 3, "the drafter", 1),
    ],
)
def test_a_fault_in_any_phase_keeps_every_finished_block(tiny_models, kind, nth, stage, finished):
    sampler = SpeculativeSampler(tiny_models, RouterConfig(tau=math.inf), config())
    fault = FailAt(kind, nth, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RunFailed) as caught:
        sampler.run(PROMPT, observers=[fault])
    message, result = str(caught.value), caught.value.result
    assert f"Block {finished} failed in {stage}" in message and "out of memory" in message
    assert "Free memory" in message and f"the {finished} finished block(s) were kept" in message
    assert result.partial and len(result.blocks) == finished
    assert result.frames.shape[0] == 12 * finished - 3 and result.latents.shape[2] == 3 * finished
    reference = SpeculativeSampler(tiny_models, RouterConfig(tau=math.inf), config()).run(PROMPT)
    assert torch.equal(result.frames, reference.frames[: result.frames.shape[0]])  # the kept blocks are the real ones
    json.dumps(result.report(), allow_nan=False)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_drafter_that_produces_nan_is_rejected_and_the_target_makes_the_block(tiny_models, pipelined):
    models = SDVGModels(target=tiny_models.target, drafter=nan_copy(tiny_models.drafter), vae=tiny_models.vae,
                        text_encoder=tiny_models.text_encoder, reward=tiny_models.reward)
    result = SpeculativeSampler(models, RouterConfig(tau=-math.inf), config(pipelined=pipelined)).run(PROMPT)
    reference = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), config()).run(PROMPT)
    assert [b.produced_by for b in result.blocks] == ["target"] * 4
    assert all("non-finite draft" in b.reason for b in result.blocks[1:])
    assert torch.equal(result.latents, reference.latents) and torch.equal(result.frames, reference.frames)


def test_a_target_that_produces_nan_stops_the_run_and_says_so(tiny_models):
    models = SDVGModels(target=nan_copy(tiny_models.target), drafter=tiny_models.drafter, vae=tiny_models.vae,
                        text_encoder=tiny_models.text_encoder, reward=tiny_models.reward)
    with pytest.raises(RunFailed, match="The target produced NaN/inf latents in block 0") as caught:
        SpeculativeSampler(models, RouterConfig(), config()).run(PROMPT)
    assert "bf16 or fp32" in str(caught.value) and caught.value.result.partial


def test_draft_only_with_a_nan_drafter_cannot_fall_back_and_says_so(tiny_models):
    models = SDVGModels(target=None, drafter=nan_copy(tiny_models.drafter), vae=tiny_models.vae,
                        text_encoder=tiny_models.text_encoder)
    with pytest.raises(RunFailed, match="no target to redo it"):
        SpeculativeSampler(models, RouterConfig(mode="draft-only"), config()).run(PROMPT)


# ---- settings refused before anything runs (API) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"pipelined": "no"}, "pipelined must be True or False"),
        ({"width": "64"}, "width must be a whole number"),
        ({"num_blocks": 2.0}, "num_blocks must be a whole number"),
        ({"refine_from_step": 99}, "refine_from_step must be between 1 and 3"),
        ({"refine_from_step": True}, "refine_from_step must be a whole number"),
        ({"schedule": [[1000, 500], [1000, 250], [1000, 100]], "num_blocks": 2}, "3 per-block lists"),
        ({"cache": "noisy"}, "cache must be a CacheConfig"),
        ({"num_blocks": 10**5, "width": 2048, "height": 2048}, "GiB for the output frames alone"),
        ({"output_dtype": "half"}, "output_dtype"),
    ],
)
def test_bad_settings_are_refused_without_any_model(kw, message):
    with pytest.raises(ConfigError, match=message):
        config(**kw).validate()


def test_wrong_models_and_embeddings_are_named(tiny_models):
    wrong = SDVGModels(target=tiny_models.target, drafter=tiny_models.drafter, vae="wan_2.1_vae.safetensors",
                       text_encoder=tiny_models.text_encoder, reward=tiny_models.reward)
    with pytest.raises(ConfigError, match="models.vae is a str"):
        SpeculativeSampler(wrong, RouterConfig(), config())
    narrow = SimpleNamespace(encode=lambda p: torch.zeros(1, 512, 32), text_dim=32)
    mismatched = SDVGModels(target=tiny_models.target, drafter=tiny_models.drafter, vae=tiny_models.vae,
                            text_encoder=narrow, reward=tiny_models.reward)
    with pytest.raises(ConfigError, match="text encoder is 32 wide"):
        SpeculativeSampler(mismatched, RouterConfig(), config())
    sampler = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), config())
    for embeds in (torch.zeros(1, 512, 8), torch.zeros(512, 64), "a fox"):
        with pytest.raises(ConfigError, match="prompt_embeds must be a float tensor"):
            sampler.run(PROMPT, prompt_embeds=embeds)


# ---- outputs (CLI) ----------------------------------------------------------------------------------------------


def _generate(tmp_path, *extra, models=None):
    missing = tmp_path / "not-there.safetensors"  # were a model loaded, this would fail: outputs are checked first
    args = ["generate", "--prompt", "x", "--device", "cpu", "--blocks", "2", *extra]
    args += ["--models", str(models)] if models else ["--target", str(missing), "--drafter", str(missing)]
    return main(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--out", "{tmp}/v.gif"], "--out {tmp}/v.gif: the file must end in .mp4 (got '.gif')"),
        (["--out", "{tmp}/v"], "the file must end in .mp4 (got no extension)"),
        (["--out", "{tmp}/v.mp4", "--report", "{tmp}/r.txt"], "--report {tmp}/r.txt: the file must end in .json"),
        (["--out", "{tmp}/v.mp4", "--timeline", "{tmp}/t.mp4"], "--timeline {tmp}/t.mp4: the file must end in .png"),
        (["--out", "{tmp}/dir.mp4"], "is a directory"),
        (["--out", "{tmp}/file.txt/v.mp4"], "is a file, not a folder"),
        (["--out", "{tmp}/v.mp4", "--save-latents", "{tmp}/a.safetensors", "--save-frames", "{tmp}/a.safetensors"],
         "--save-latents and --save-frames are the same file"),
        (["--out", "{tmp}/v.mp4", "--save-latents", "{tmp}/model.safetensors"], "is an existing model file"),
    ],
)
def test_bad_outputs_are_refused_before_any_model_loads(tmp_path, capsys, extra, message):
    (tmp_path / "dir.mp4").mkdir()
    (tmp_path / "file.txt").write_text("x")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    code = _generate(tmp_path, *[e.format(tmp=tmp_path) for e in extra])
    err = capsys.readouterr().err
    assert code == 2 and message.format(tmp=tmp_path) in err and "not-there" not in err
    assert (tmp_path / "model.safetensors").stat().st_size > 0  # never overwritten


def test_our_own_safetensors_output_may_be_overwritten(tiny_dir, tmp_path):
    args = ("--out", str(tmp_path / "v.mp4"), "--save-latents", str(tmp_path / "l.safetensors"), "--mode",
            "target-only")
    assert _generate(tmp_path, *args, models=tiny_dir) == 0
    assert _generate(tmp_path, *args, models=tiny_dir) == 0


def test_a_failing_video_write_still_writes_the_report_and_leaves_no_broken_file(tiny_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    from sdvg.outputs import video

    def disk_full(self, frames):  # the disk fills up while the first block is encoded
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(video._Encoder, "write", disk_full)
    out, report = tmp_path / "v.mp4", tmp_path / "r.json"
    code = _generate(tmp_path, "--out", str(out), "--report", str(report), "--mode", "target-only", models=tiny_dir)
    err = capsys.readouterr().err
    assert code == 2 and f"could not write --out {out}" in err and "No space left on device" in err
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))  # no broken file, no temporary left
    assert len(json.loads(report.read_text())["blocks"]) == 2


def test_a_fault_mid_run_writes_the_finished_blocks_and_exits_2(tiny_dir, tmp_path, monkeypatch, capsys):
    from sdvg.models.reward import ImageReward

    calls = {"n": 0}
    score = ImageReward.score

    def dies_on_the_second_call(self, frames, prompt, **kw):  # the reward model's device is lost mid-run
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return score(self, frames, prompt, **kw)

    monkeypatch.setattr(ImageReward, "score", dies_on_the_second_call)
    out, report = tmp_path / "v.mp4", tmp_path / "r.json"
    code = _generate(tmp_path, "--out", str(out), "--report", str(report), "--blocks", "4", "--tau=-inf",
                     models=tiny_dir)
    err = capsys.readouterr().err
    assert code == 2 and "error: Block 2 failed in the reward model (ImageReward)" in err and "device-side" in err
    data = json.loads(report.read_text())
    assert data["partial"] is True and [b["block"] for b in data["blocks"]] == [0, 1]
    from sdvg.outputs import read_video_frames

    assert len(read_video_frames(out)) == 21


def test_refine_beyond_the_schedule_is_refused_up_front(tmp_path, capsys):
    assert _generate(tmp_path, "--out", str(tmp_path / "v.mp4"), "--schedule", "constant", "--refine-from-step", "9") == 2
    assert "refine_from_step must be between 1 and 3" in capsys.readouterr().err


def test_cache_config_rejects_non_integers():
    with pytest.raises(ConfigError, match="whole number"):
        CacheConfig("noisy", sink_frames=1.5)


def test_an_exception_from_the_callers_own_callback_passes_through_unchanged(tiny_models):
    """A host's interrupt raised in on_step (ComfyUI's progress hook) is the caller's, not a model fault."""

    class HostInterrupt(Exception):
        pass

    def on_step(event):
        if event.block == 1:
            raise HostInterrupt()

    sampler = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), config())
    with pytest.raises(HostInterrupt):
        sampler.run(PROMPT, on_step=on_step)
