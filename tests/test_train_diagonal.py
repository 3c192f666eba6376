"""Diagonal Distillation training (``sdvg/train``): the rollout and its one-forward gradient recomputation equal the
cached sampler path, the DMD gradient, the config file and bad inputs, a one-minute training smoke run (losses fall,
resume, the student loads in the sampler); the multi-process runs are in test_train_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.loaders.wan import load_dit
from sdvg.sampling.scheduler import FlowMatchScheduler, build_step_schedule
from sdvg.toy.preset import FLOW_DRAFTER_FILE, TOY_DIR, toy_files
from sdvg.train.config import load_config
from sdvg.train.dmd import MotionMatcher, ScoreNoise, dmd_gradients, fake_score_loss, generator_loss
from sdvg.train.rollout import RolloutNoise, TrainForward, rollout, student_x0

FLOW_DRAFTER = TOY_DIR / FLOW_DRAFTER_FILE  # the small flow-matching toy drafter: a fast student for the smoke runs

SHAPE = (2, 16, 9, 8, 8)  # 2 videos, 3 blocks of the toy world's latents


@pytest.fixture(scope="module")
def drafter():
    return load_dit(FLOW_DRAFTER, dtype="fp32")


def test_forward_with_context_equals_the_per_block_forward(drafter):
    """Each block given clean context = the block-causal forward over [clean blocks before it, the noisy block]."""
    gen = torch.Generator().manual_seed(0)
    clean, noisy = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    t = torch.rand(2, 9, generator=gen) * 1000
    with torch.no_grad():
        cross = drafter.cross_attention(torch.randn(2, 12, 64, generator=gen))
        out = drafter.forward_with_context(clean, torch.zeros(2, 9), noisy, t, cross)
        for b in range(3):
            x = torch.cat([clean[:, :, :3 * b], noisy[:, :, 3 * b:3 * b + 3]], 2)
            tt = torch.cat([torch.zeros(2, 3 * b), t[:, 3 * b:3 * b + 3]], 1)
            ref = drafter.forward_train(x, tt, cross)[:, :, 3 * b:]
            assert torch.allclose(out[:, :, 3 * b:3 * b + 3], ref, atol=1e-5, rtol=1e-5), b
        same = drafter.forward_with_context(noisy, t, noisy, t, cross)
        assert torch.allclose(same, drafter.forward_train(noisy, t, cross), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["noisy", "clean"])
@pytest.mark.parametrize("step_noise", ["fresh", "predicted"])
def test_gradient_forward_equals_the_cached_rollout(drafter, cache, step_noise):
    """The student's one-forward recomputation of every block's exit step = the cached block-by-block rollout."""
    sch = FlowMatchScheduler()
    schedule = build_step_schedule("diagonal", 3, sch)
    gen = torch.Generator().manual_seed(1)
    noise = RolloutNoise.draw(gen, SHAPE, schedule, 3)
    emb = torch.randn(2, 16, 64, generator=gen)
    for exits in ([3, 2, 1], [0, 1, 0]):
        r = rollout(drafter, emb, noise, schedule, exits, cache=cache, scheduler=sch, step_noise=step_noise)
        assert r.t_exit[0, ::3].tolist() == pytest.approx([schedule[b][k] for b, k in enumerate(exits)])
        x0 = student_x0(TrainForward(drafter), r, emb, cache)
        assert torch.allclose(x0, r.x0, atol=1e-5, rtol=1e-5), (exits, float((x0 - r.x0).abs().max()))


def test_gradient_checkpointing_gives_the_same_gradients():
    model = load_dit(FLOW_DRAFTER, dtype="fp32").train().requires_grad_(True)
    gen = torch.Generator().manual_seed(2)
    x, t, emb = torch.randn(SHAPE, generator=gen), torch.rand(2, 9, generator=gen) * 1000, torch.randn(2, 8, 64)
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = flag
        model.forward_train(x, t, model.cross_attention(emb)).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*grads, strict=True))


def test_dmd_gradient_and_generator_loss():
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(SHAPE, generator=gen).requires_grad_(True)
    real, fake = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    grad, _ = dmd_gradients(x0, real, real.clone())
    assert float(grad.abs().max()) == 0.0  # the fake score equals the real one: nothing to match
    loss, parts = generator_loss(x0, real, fake, flow_weight=0.0, motion=None)
    loss.backward()
    grad, _ = dmd_gradients(x0, real, fake)
    assert torch.allclose(x0.grad, grad / x0.numel(), atol=1e-9)  # d loss / d x0 is the normalized DMD gradient
    assert set(parts) == {"dmd"}
    norm = (x0.detach() - real).abs().mean(dim=(1, 2, 3, 4))
    assert torch.allclose((grad * norm.view(-1, 1, 1, 1, 1)), fake - real, atol=1e-5)
    loss, parts = generator_loss(x0, real, fake, flow_weight=0.2, motion=MotionMatcher(16, 8))
    assert set(parts) == {"dmd", "flow", "motion_head"} and parts["flow"] > 0


def test_fake_score_loss_is_flow_matching(drafter):
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(SHAPE, generator=gen)
    noise = ScoreNoise.draw(gen, SHAPE, min_t=0.02, max_t=0.98, shift=5.0)
    assert bool(((noise.t >= 20) & (noise.t <= 980)).all())
    loss = fake_score_loss(TrainForward(drafter), x0, noise, torch.randn(2, 8, 64))
    assert loss.dim() == 0 and float(loss) > 0


def test_config_file_overrides_and_errors(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"batch": 4, "schedule": "constant", "latent_hw": [8, 8]}))
    cfg = load_config(cfg_file, batch=2)
    assert (cfg.batch, cfg.schedule, cfg.latent_hw, cfg.cache, cfg.flow_weight) == (2, "constant", (8, 8), "noisy", 0.2)
    cfg_file.write_text(json.dumps({"bacth": 4}))
    with pytest.raises(ConfigError, match="Unknown training config key"):
        load_config(cfg_file)
    with pytest.raises(ConfigError, match="cache must be one of"):
        load_config(None, cache="warm")
    with pytest.raises(ConfigError, match="needs text_encoder"):
        load_config(None, data="prompts.txt")


@pytest.mark.parametrize("argv, message", [
    (["--teacher", "/nope/teacher.safetensors"], "Missing file(s): teacher"),
    (["--batch", "0"], "batch must be at least 1"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--schedule", "[[1000, 500"], "not valid JSON"),
    (["--data", "/nope/prompts"], "does not exist"),
])
def test_bad_training_input_exits_2_before_loading(tmp_path, capsys, argv, message):
    from sdvg.cli.commands import main

    args = ["train", "diagonal", "--out", str(tmp_path / "o"), *argv]
    if argv[0] == "--data":
        args += ["--text-encoder", str(toy_files()["text_encoder"])]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "state.pt").exists()


def _probe_fake_loss(fake_state, student) -> float:
    """The fake score's flow loss on a fixed batch of the initial student's videos (the distribution it must fit)."""
    fake = load_dit(FLOW_DRAFTER, dtype="fp32")  # the smoke run's teacher, so its fake score's initial weights
    if fake_state is not None:
        fake.load_state_dict(fake_state)
    sch = FlowMatchScheduler()
    schedule = build_step_schedule("diagonal", 3, sch)
    gen = torch.Generator().manual_seed(123)
    shape = (8, *SHAPE[1:])
    from sdvg.train.data import load_prompts

    bank = load_prompts("toy", None, None)
    emb = bank(bank.draw(gen, 8))
    roll = rollout(student, emb, RolloutNoise.draw(gen, shape, schedule, 3), schedule, [3, 2, 1], cache="noisy",
                   scheduler=sch)
    noise = ScoreNoise.draw(gen, shape, min_t=0.02, max_t=0.98, shift=5.0)
    with torch.no_grad():
        return float(fake_score_loss(TrainForward(fake), roll.x0, noise, emb))


def test_train_smoke_losses_fall_resume_and_the_student_loads_in_the_sampler(tmp_path, drafter):
    """`python -m sdvg train diagonal --max-steps N` on the toy world: the fake score fits the student's videos
    (its loss on a fixed probe batch falls), a rerun with more steps resumes, student.pt is Self-Forcing's layout and
    the CLI generates with it as the drafter on its diagonal schedule."""
    from sdvg.cli.commands import main
    from sdvg.loaders.checkpoint import torch_load

    out = tmp_path / "dd"
    (tmp_path / "c.json").write_text(json.dumps({"ode_pairs": 16, "gen_every": 1}))
    base = ["train", "diagonal", "--config", str(tmp_path / "c.json"), "--out", str(out), "--batch", "4",
            "--threads", "1", "--student-init", str(FLOW_DRAFTER), "--teacher", str(FLOW_DRAFTER)]
    assert main([*base, "--max-steps", "8"]) == 0
    st = torch_load(out / "state.pt")
    assert st["step"] == 8
    before, after = _probe_fake_loss(None, drafter), _probe_fake_loss(st["fake"], drafter)
    assert after < 0.9 * before, (before, after)  # measured 0.144 -> 0.119
    info = json.loads((out / "train.json").read_text())
    assert info["steps"] == 8 and info["s_per_iter"] > 0 and info["peak_memory_mb"] > 0
    assert [s for s, _ in info["losses"]["dmd"]] == list(range(1, 9)) and len(info["losses"]["fake"]) == 8
    assert {"regression", "flow", "motion_head"} <= set(info["losses"])
    assert (out / "ode_pairs.pt").is_file()
    assert main([*base, "--max-steps", "10"]) == 0  # resumes at 8
    info = json.loads((out / "train.json").read_text())
    assert info["steps"] == 10 and [s for s, _ in info["losses"]["fake"]] == list(range(1, 11))
    pt = torch_load(out / "student.pt")
    assert set(pt) == {"generator", "generator_ema", "config"} and all(k.startswith("model.") for k in pt["generator"])
    moved = max(float((pt["generator"][k] - torch_load(FLOW_DRAFTER)["generator"][k]).abs().max())
                for k in pt["generator"])
    assert moved > 0
    video = tmp_path / "v.mp4"
    assert main(["generate", "--prompt", "a red circle moving left on a black background", "--drafter",
                 str(out / "student.pt"), "--mode", "draft-only", "--drafter-schedule", "diagonal",
                 "--drafter-step-noise", "fresh", "--cache", "noisy", "--out", str(video), "--report",
                 str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [b["steps"] for b in report["blocks"]] == [4, 3, 2]


def test_teacher_fidelity_measures_distance_to_the_teachers_video():
    """The study's fidelity metric: latent MSE to the teacher's video from the same held-out noise; the undistilled
    drafter on the few-step diagonal schedule is far from it, and the value is reproducible."""
    from sdvg.train.measure import teacher_fidelity

    cfg = load_config(None)
    a = teacher_fidelity(str(FLOW_DRAFTER), cfg, n=4)
    b = teacher_fidelity(str(FLOW_DRAFTER), cfg, n=4)
    assert a == b and a["n"] == 4 and 0.0 < a["mse_lo"] <= a["mse"] <= a["mse_hi"] < 10.0
