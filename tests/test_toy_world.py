"""The toy world: renderer, captions, the patch latent model, the judge, the training forward, a one-minute training
smoke run in the real file formats, and the committed trained models loading and generating."""

from __future__ import annotations

import json

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.loaders.patch_vae import is_patch_vae_file, write_patch_vae
from sdvg.models.patch_vae import PatchLatentModel, PatchVAE, fit_patch_bases
from sdvg.toy.judge import chance_corrected, judge, judge_metric, validate_judge
from sdvg.toy.world import (
    CLIP_FRAMES,
    all_captions,
    centres,
    held_out_captions,
    parse_caption,
    render,
    render_batch,
    sample_scene,
    train_captions,
    v1_captions,
)


def test_world_is_seeded_and_captions_round_trip():
    a, sa = render_batch(torch.Generator().manual_seed(3), 2)
    b, sb = render_batch(torch.Generator().manual_seed(3), 2)
    assert torch.equal(a, b) and sa == sb
    assert a.shape == (2, CLIP_FRAMES, 64, 64, 3) and 0 <= float(a.min()) and float(a.max()) <= 1
    caps = all_captions()
    assert len(caps) == len(set(caps)) == 216
    held, train = held_out_captions(), train_captions()
    assert len(held) == 72 and len(train) == 144 and not set(held) & set(train) and set(held) | set(train) == set(caps)
    for a in ("background", "colour", "shape", "direction"):  # every word is trained on, only combinations are new
        assert {parse_caption(c)[a] for c in held} == {parse_caption(c)[a] for c in train}
    assert len(v1_captions()) == 72 and set(v1_captions()) <= set(caps)
    _, scenes = render_batch(torch.Generator().manual_seed(4), 16, 5, pool=train)
    assert all(s.caption in train for s in scenes)
    for c in caps[::7]:
        scene = sample_scene(torch.Generator().manual_seed(1), caption=c)
        assert scene.caption == c and parse_caption(c) == scene.attributes()
    with pytest.raises(ConfigError, match="no shape 'hexagon'"):
        parse_caption("a red hexagon moving left on a black background")
    with pytest.raises(ConfigError, match="not a toy-world caption"):
        parse_caption("a fox in the snow")


def test_toy_eval_defaults_to_every_held_out_caption_with_two_seeds():
    from sdvg.toy import toy_eval_items

    prompts, seeds = toy_eval_items()
    assert len(prompts) == len(seeds) == 144 and set(prompts) == set(held_out_captions())
    assert sorted(set(zip(prompts, seeds, strict=True))) == sorted((c, s) for c in held_out_captions() for s in (0, 1))
    quick, qseeds = toy_eval_items(quick=True)
    assert len(set(quick)) == len(quick) == 8 and set(quick) <= set(held_out_captions()) and set(qseeds) == {0}
    assert quick == held_out_captions(8) and len(set(held_out_captions(24))) == 24
    assert held_out_captions(500) == held_out_captions()  # more than there are: all of them
    with pytest.raises(ConfigError, match="at least one held-out caption"):
        held_out_captions(0)


def test_objects_move_their_way_stay_inside_and_bounce_on_long_clips():
    gen = torch.Generator().manual_seed(0)
    for caption in ("a red circle moving left on a black background", "a blue square moving down on a white background"):
        s = sample_scene(gen, caption=caption)
        c = centres(s, CLIP_FRAMES)
        d = c[-1] - c[0]
        if "left" in caption:
            assert d[0] < -0.2 and abs(d[1]) < 1e-9
        else:
            assert d[1] > 0.2 and abs(d[0]) < 1e-9
        assert float(c.min()) >= s.radius - 1e-9 and float(c.max()) <= 1 - s.radius + 1e-9
        long = centres(s, 400)
        assert float(long.min()) >= s.radius - 1e-9 and float(long.max()) <= 1 - s.radius + 1e-9


@pytest.fixture(scope="module")
def patch_vae():
    clips, _ = render_batch(torch.Generator().manual_seed(0), 48)
    return PatchVAE(PatchLatentModel(fit_patch_bases(clips)))


def test_patch_vae_round_trip_streams_like_the_wan_vae(patch_vae, tmp_path):
    scene = sample_scene(torch.Generator().manual_seed(9))
    clip = render(scene)
    z = patch_vae.encode_video(clip)
    assert z.shape == (1, 16, 9, 8, 8)
    patch_vae.reset()
    blocks = [patch_vae.decode_block(z[:, :, i:i + 3]) for i in (0, 3, 6)]
    assert [b.shape[0] for b in blocks] == [9, 12, 12]  # 1 + 4·2, then 4 per latent frame
    rec = torch.cat(blocks)
    psnr = 10 * torch.log10(1 / ((rec - clip) ** 2).mean())
    assert psnr > 22, psnr
    # snapshot / restore: a re-decoded block after a restore is identical
    patch_vae.reset()
    patch_vae.decode_block(z[:, :, :3])
    snap = patch_vae.snapshot()
    first = patch_vae.decode_block(z[:, :, 3:6])
    patch_vae.restore(snap)
    assert torch.equal(patch_vae.decode_block(z[:, :, 3:6]), first)
    # encode_frame is the first latent frame of a video
    assert torch.allclose(patch_vae.encode_frame(clip[:1]), z[:, :, :1], atol=1e-5)
    # the file is recognised by its metadata and opened as the streaming VAE
    from sdvg.loaders.vae_open import open_vae

    path = write_patch_vae(patch_vae.tensors(), tmp_path / "vae" / "toy.safetensors")
    assert is_patch_vae_file(path)
    again = open_vae(path, device="cpu")
    again.reset()
    assert torch.equal(again.decode_block(z[:, :, :3]), blocks[0])


def test_judge_tells_renders_from_noise_and_flat_fields():
    res = validate_judge(12)
    assert res["real"] >= 0.9 and res["noise"] <= 0.3 and res["real_smooth"] >= 0.9, res
    caption = "a green triangle moving up on a white background"
    scene = sample_scene(torch.Generator().manual_seed(4), caption=caption)
    clip = render(scene)
    v = judge(clip, caption)
    assert v.valid and v.all_correct and v.attributes == parse_caption(caption)
    # the same video judged against another caption: exactly the differing attributes are wrong
    other = judge(clip, "a red triangle moving down on a white background")
    assert other.correct == {"background": True, "colour": False, "shape": True, "direction": False}
    assert other.accuracy == 0.5
    assert judge(torch.full_like(clip, 0.95), caption).accuracy == 0.0  # a flat field is not a picture
    m = judge_metric((clip * 255).round().to(torch.uint8), caption)
    assert m["judge"] == 1.0 and m["judge_valid"] == 1.0 and m["judge_smooth"] == 1.0 and m["judge_chance"] == 1.0
    # chance-corrected: wrong direction and shape score below zero; guessing rates score exactly zero
    wrong = judge_metric(clip, "a green circle moving down on a white background")
    assert wrong["judge_chance"] == pytest.approx(-(0.5 + 1 / 3) / 2)
    assert chance_corrected(1 / 3, 1 / 4) == pytest.approx(0.0)
    # the new palette: every held-out caption's render is read right
    for c in held_out_captions()[::9]:
        assert judge(render(sample_scene(torch.Generator().manual_seed(2), caption=c)), c).all_correct, c
    # a clip whose object jumps back and forth is still the right picture but not smooth
    jumpy = torch.cat([clip[:8], clip[-8:], clip[8:25]])
    assert judge(jumpy, caption).smooth < 0.95


@pytest.mark.parametrize("patch", [2, 1])
def test_training_forward_equals_the_cached_block_forward(patch):
    """forward_train (block-causal mask, autograd) computes what the sampler's cached block-by-block forward does,
    at both patch sizes."""
    from sdvg.toy.dit_train import DiTSpec, build_dit

    model = build_dit(DiTSpec(heads=2, head_dim=16, ffn=64, layers=2, text_dim=64, patch=patch), seed=0).eval()
    x = torch.randn(1, 16, 6, 8, 8)
    t = torch.tensor([[0.0, 0.0, 0.0, 700.0, 700.0, 700.0]])
    emb = torch.randn(1, 12, 64)
    with torch.no_grad():
        full = model.forward_train(x, t, model.cross_attention(emb))
    cross = model.prepare_cross_attention(emb)
    kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
    first = model.forward_block(x[:, :, :3], t[:, :3], kv, cross, frame_offset=0)
    second = model.forward_block(x[:, :, 3:], t[:, 3:], kv, cross, frame_offset=3)
    assert torch.allclose(full[:, :, :3], first, atol=1e-5)
    assert torch.allclose(full[:, :, 3:], second, atol=1e-5)


def test_toy_train_smoke_writes_real_formats_that_load_and_generate(tmp_path):
    """`python -m sdvg toy train --max-steps 12`: every stage runs, the losses fall, the files are the real formats
    (Krea-style safetensors target, Self-Forcing .pt drafter, Comfy-Org UMT5, ImageReward .pt critic) and the
    sampler runs them; a rerun resumes (skips every finished stage)."""
    from sdvg.cli.commands import main
    from sdvg.loaders.checkpoint import torch_load
    from sdvg.toy.train import FILES

    out, work = tmp_path / "models", tmp_path / "work"
    assert main(["toy", "train", "--out", str(out), "--work", str(work), "--max-steps", "12", "--threads", "1"]) == 0
    for rel in FILES.values():
        assert (out / rel).is_file(), rel
    stamp = json.loads((out / "sdvg_toy.json").read_text())
    assert stamp["command"] == "python -m sdvg toy train" and stamp["stages"]["target"]["steps"] == 12
    assert stamp["stages"]["target"]["command"] == (f"python -m sdvg toy train --out {out} --work {work} "
                                                    "--max-steps 12 --threads 1")
    for role in ("target", "drafter"):
        losses = torch_load(work / f"state_{role}.pt")["losses"]
        assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, (role, losses)
    pt = torch_load(out / FILES["drafter"])
    assert set(pt) == {"generator", "generator_ema", "config"} and all(k.startswith("model.") for k in pt["generator"])
    mtimes = {p: (out / p).stat().st_mtime_ns for p in FILES.values()}
    assert main(["toy", "train", "--out", str(out), "--work", str(work), "--max-steps", "12"]) == 0
    assert mtimes == {p: (out / p).stat().st_mtime_ns for p in FILES.values()}

    from sdvg.loaders.reward import load_image_reward
    from sdvg.models.patch_vae import PatchVAE
    from sdvg.toy.sheet import load_toy_models, run_toy

    models = load_toy_models(out)
    assert isinstance(models.vae, PatchVAE)
    assert load_image_reward(out / FILES["reward"]).config.image_size == 64
    res = run_toy(models, "a red circle moving left on a black background", "reward", tau=0.0, num_blocks=2)
    assert res.frames.shape == (21, 64, 64, 3) and [b.drafted for b in res.blocks] == [False, True]


def test_committed_toy_models_load_and_generate():
    from sdvg.toy.preset import toy_files, toy_tree
    from sdvg.toy.sheet import load_toy_models, run_toy

    files = toy_files(toy_tree())
    assert sum(p.stat().st_size for p in files.values()) <= 25 * 10**6
    assert all(p.stat().st_size <= 10 * 10**6 for p in files.values())
    models = load_toy_models()
    res = run_toy(models, "a blue square moving right on a white background", "target-only", num_blocks=1)
    assert res.frames.shape == (9, 64, 64, 3) and torch.isfinite(res.frames).all()
    assert float(res.frames.std()) > 0.05  # a picture, not a constant


TOY = "a green circle moving down on a black background"


def test_generate_defaults_to_the_toy_models_and_a_given_file_replaces_its_role(tmp_path, tiny_reward_path, capsys):
    from sdvg.cli.commands import main

    out, rep = tmp_path / "v.mp4", tmp_path / "r.json"
    assert main(["generate", "--prompt", TOY, "--device", "cpu", "--blocks", "2", "--tau", "1.25",
                 "--out", str(out), "--report", str(rep)]) == 0
    err = capsys.readouterr().err
    assert "toy world's trained models" in err
    report = json.loads(rep.read_text())
    assert report["settings"]["width"] == 64 and len(report["settings"]["schedule"][0]) == 10
    assert main(["generate", "--prompt", TOY, "--device", "cpu", "--blocks", "2", "--reward", str(tiny_reward_path),
                 "--out", str(out), "--report", str(rep)]) == 0
    assert "for every role but reward" in capsys.readouterr().err


def test_eval_world_toy_writes_judge_columns_and_refine_rows(tmp_path):
    import csv

    from sdvg.cli.commands import main

    out = tmp_path / "ev"
    assert main(["eval", "--world", "toy", "--quick", "--out", str(out), "--limit", "2", "--taus", "1.25",
                 "--rates", "0.4", "--blocks", "2", "--no-videos", "--device", "cpu"]) == 0
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert {"method", "tau", "acceptance", "speedup", "speedup_real", "judge", "judge_lo", "judge_hi",
            "judge_chance"} <= set(rows[0])
    assert {r["method"] for r in rows} == {"target-only", "draft-only", "target0-draft", "sdvg", "random", "refine",
                                           "sdvg-rate", "random-rate"}
    results = list(csv.DictReader((out / "results.csv").open()))
    assert {r["prompt"] for r in results} <= set(held_out_captions())  # the eval's prompts are held out
    assert {r["method"] for r in csv.DictReader((out / "paired.csv").open())} == {"sdvg", "sdvg-rate"}
    assert all(0.0 <= float(r["judge_lo"]) <= float(r["judge"]) <= float(r["judge_hi"]) <= 1.0 for r in rows)
    assert (out / "pareto.png").stat().st_size > 1000


def test_ema_warms_up_so_early_exports_are_not_the_initial_weights():
    from sdvg.toy.dit_train import ema_decay

    assert ema_decay(0, 0.998) == pytest.approx(0.1) and ema_decay(90, 0.998) == pytest.approx(0.91)
    assert ema_decay(10**6, 0.998) == 0.998
    weight_of_init = 1.0
    for step in range(500):
        weight_of_init *= ema_decay(step, 0.998)
    assert weight_of_init < 1e-3  # a fixed 0.998 leaves 0.998 ** 500 ≈ 0.37


def test_a_dit_stage_warm_starts_from_an_exported_checkpoint(patch_vae, tmp_path):
    from sdvg.fixtures.tiny import write_krea_safetensors
    from sdvg.loaders.checkpoint import torch_load
    from sdvg.toy.dit_train import CaptionBank, DiTSpec, DiTTrainSettings, original_state_dict, train_dit
    from sdvg.toy.world import train_captions

    gen = torch.Generator().manual_seed(0)
    bank = CaptionBank(lambda c: torch.randn(1, 8, 64, generator=gen), train_captions())
    spec = DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=1)
    for d in "abc":
        (tmp_path / d).mkdir()
    first = train_dit("target", spec, DiTTrainSettings(steps=2, batch=1, save_every=2, warmup=1), patch_vae, bank,
                      tmp_path / "a")
    export = write_krea_safetensors(tmp_path / "ckpt.safetensors", original_state_dict(first), spec.heads)
    # nothing left to train: the model is the export (bf16 in the file)
    same = train_dit("target", spec, DiTTrainSettings(steps=2, batch=1, save_every=2, warmup=1), patch_vae, bank,
                     tmp_path / "b", warm_start=(export, 2))
    for (k, a), b in zip(first.state_dict().items(), same.state_dict().values(), strict=True):
        assert torch.equal(a.to(torch.bfloat16).float(), b), k
    # one more step from the export: training continues at step 2 and writes its own state
    train_dit("target", spec, DiTTrainSettings(steps=3, batch=1, save_every=1, warmup=1), patch_vae, bank,
              tmp_path / "c", warm_start=(export, 2))
    st = torch_load(tmp_path / "c" / "state_target.pt")
    assert st["step"] == 3 and len(st["losses"]) == 1


def test_shape_pairs_are_one_training_scene_in_two_shapes():
    """Every training caption has exactly one shape partner, a training caption that differs only in the shape word
    (the third shape is held out); a rendered pair is one scene — place, size, motion, colours — in the two shapes."""
    from sdvg.toy.world import render_shape_pairs, shape_partner, train_captions

    train = set(train_captions())
    for caption in train:
        partner = shape_partner(caption)
        a, b = parse_caption(caption), parse_caption(partner)
        assert partner in train and a["shape"] != b["shape"]
        assert {k: v for k, v in a.items() if k != "shape"} == {k: v for k, v in b.items() if k != "shape"}
        assert shape_partner(partner) == caption
    with pytest.raises(ConfigError, match="held-out"):
        shape_partner(held_out_captions(1)[0])
    clips, scenes = render_shape_pairs(torch.Generator().manual_seed(4), 3, 9)
    assert clips.shape == (6, 9, 64, 64, 3) and len(scenes) == 6
    for first, second in zip(scenes[::2], scenes[1::2], strict=True):
        assert second.caption == shape_partner(first.caption)
        assert (first.x, first.y, first.radius, first.speed) == (second.x, second.y, second.radius, second.speed)
    differ = (clips[0] != clips[1]).any(-1)
    assert differ.any() and differ.float().mean() < 0.1  # only the outline's cells change


def test_paired_flow_loss_shares_noise_within_a_pair_and_the_contrast_subtracts_the_partner_error():
    """``pairs``: a pair's two samples get the same σ and noise, so two identical clips give identical predictions;
    ``contrast`` λ: the loss is the plain error minus λ × the error against the partner's target (computed here by
    hand from the same draws); the plain path draws exactly what it drew before pairs existed."""
    from sdvg.models.dit import CausalWanTransformer
    from sdvg.toy.dit_train import DiTSpec, DiTTrainSettings, flow_loss

    torch.manual_seed(0)
    model = CausalWanTransformer(**DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=1).config()).float()
    x0, embeds = torch.randn(4, 16, 6, 8, 8), torch.randn(4, 8, 64)
    embeds[1], x0[1] = embeds[0], x0[0]
    gen = torch.Generator().manual_seed(1)
    plain = flow_loss(model, x0, embeds, 0, torch.Generator().manual_seed(1))
    sigma, eps = torch.rand(4, generator=gen), torch.randn(4, 16, 3, 8, 8, generator=gen)
    s = sigma.view(4, 1, 1, 1, 1)
    t = (sigma * 1000).view(4, 1).expand(4, 3)
    v = model.forward_train((1 - s) * x0[:, :, :3] + s * eps, t, model.cross_attention(embeds))
    torch.testing.assert_close(plain, torch.nn.functional.mse_loss(v, eps - x0[:, :, :3]))

    gen = torch.Generator().manual_seed(1)
    sigma, eps = torch.rand(2, generator=gen).repeat_interleave(2), torch.randn(2, 16, 3, 8, 8, generator=gen)
    eps = eps.repeat_interleave(2, dim=0)
    s = sigma.view(4, 1, 1, 1, 1)
    v = model.forward_train((1 - s) * x0[:, :, :3] + s * eps, (sigma * 1000).view(4, 1).expand(4, 3),
                            model.cross_attention(embeds))
    torch.testing.assert_close(v[0], v[1])  # one clip, one caption, shared draws: one prediction
    target = eps - x0[:, :, :3]
    err = (v - target).square().mean()
    err_partner = (v - target[[1, 0, 3, 2]]).square().mean()
    paired = flow_loss(model, x0, embeds, 0, torch.Generator().manual_seed(1), pairs=True)
    contrasted = flow_loss(model, x0, embeds, 0, torch.Generator().manual_seed(1), pairs=True, contrast=0.3)
    torch.testing.assert_close(paired, err)
    torch.testing.assert_close(contrasted, err - 0.3 * err_partner)
    for bad, match in (({"shape_contrast": 1.0}, "in \\[0, 1\\)"), ({"shape_contrast": 0.2}, "needs shape_pairs"),
                       ({"shape_pairs": True, "batch": 3}, "even batch")):
        with pytest.raises(ConfigError, match=match):
            DiTTrainSettings(**bad)


def test_a_deepened_dit_computes_what_its_base_does_and_its_new_blocks_train():
    """``deepened``: the base's blocks copied, the appended ones with zero output projections — the same predictions
    to the bit at step 0 — and a gradient on those projections, so training can move them; fewer layers than the
    base is a ConfigError."""
    from sdvg.toy.dit_train import DiTSpec, build_dit, deepened

    spec = DiTSpec(heads=1, head_dim=32, ffn=64, layers=2, patch=1)
    base = build_dit(spec, 0).eval()
    deep = deepened(base, DiTSpec(heads=1, head_dim=32, ffn=64, layers=3, patch=1), 1)
    assert len(deep.blocks) == 3 and float(deep.blocks[2].ffn.net[2].weight.detach().abs().sum()) == 0.0
    assert float(deep.blocks[2].attn1.to_q.weight.detach().abs().sum()) > 0  # a fresh block, not a zero one
    x, t, e = torch.randn(1, 16, 3, 8, 8), torch.full((1, 3), 400.0), torch.randn(1, 8, 64)
    with torch.no_grad():
        want = base.forward_train(x, t, base.cross_attention(e))
    got = deep.forward_train(x, t, deep.cross_attention(e))
    assert torch.equal(got, want)
    got.square().mean().backward()
    assert float(deep.blocks[2].ffn.net[2].weight.grad.abs().sum()) > 0
    with pytest.raises(ConfigError, match="at least the base's 2 layers"):
        deepened(base, DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=1), 1)
    with pytest.raises(ConfigError, match="more than its depth"):
        deepened(base, DiTSpec(heads=1, head_dim=32, ffn=128, layers=3, patch=1), 1)


def test_per_channel_latent_statistics_give_every_channel_unit_variance_and_the_same_pixels():
    """``fit_patch_bases(per_channel=True)``: the same bases and pixels as the global scale, each channel of the fit
    clips' latents at unit variance (the global one leaves the first component several times the last), and
    ``channel_variances`` equal to the variance of the raw latents it is computed from."""
    from sdvg.models.patch_vae import channel_variances

    clips, _ = render_batch(torch.Generator().manual_seed(0), 24)
    flat, white = fit_patch_bases(clips), fit_patch_bases(clips, per_channel=True)
    for k in ("first.basis", "group.basis", "first.mean", "group.mean"):
        assert torch.equal(flat[k], white[k])
    v_flat, v_white = PatchVAE(PatchLatentModel(flat)), PatchVAE(PatchLatentModel(white))
    z_flat = torch.cat([v_flat.encode_video(c) for c in clips], 2)
    z_white = torch.cat([v_white.encode_video(c) for c in clips], 2)
    std_white = z_white.transpose(0, 1).reshape(16, -1).std(1)
    torch.testing.assert_close(std_white, torch.ones(16), atol=2e-3, rtol=0)
    std_flat = z_flat.transpose(0, 1).reshape(16, -1).std(1)
    assert float(std_flat[0] / std_flat[-1]) > 5
    raw = v_flat.denormalize(z_flat)
    torch.testing.assert_close(channel_variances(flat, clips), raw.transpose(0, 1).reshape(16, -1).var(1), rtol=1e-4,
                               atol=1e-6)
    torch.testing.assert_close(v_white.decode_block(z_white[:, :, :3]), v_flat.decode_block(z_flat[:, :, :3]), atol=1e-4,
                               rtol=0)


def test_a_rescaled_dit_predicts_in_the_new_channel_units():
    """``rescaled_channels(model, r)``: fed the clean latent in the new units (x / r) it predicts the old model's
    output in the new units (out / r), channel by channel; a ratio of the wrong size, a non-positive one or a patch
    other than 1x1x1 is a ConfigError."""
    from sdvg.toy.dit_train import DiTSpec, build_dit, rescaled_channels

    spec = DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=1)
    old = build_dit(spec, 0).eval()
    ratio = torch.linspace(0.25, 4.0, 16)
    new = rescaled_channels(build_dit(spec, 0).eval(), ratio)
    x, t, e = torch.randn(1, 16, 3, 8, 8), torch.full((1, 3), 400.0), torch.randn(1, 8, 64)
    r = ratio.view(1, 16, 1, 1, 1)
    with torch.no_grad():
        want = old.forward_train(x, t, old.cross_attention(e))
        got = new.forward_train(x / r, t, new.cross_attention(e))
    torch.testing.assert_close(got * r, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="16 positive channel ratios"):
        rescaled_channels(old, torch.ones(8))
    with pytest.raises(ConfigError, match="16 positive channel ratios"):
        rescaled_channels(old, torch.zeros(16))
    with pytest.raises(ConfigError, match="patch-1x1x1"):
        rescaled_channels(build_dit(DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=2), 0), torch.ones(16))


def test_the_object_weighted_flow_loss_weighs_the_object_cells_and_reduces_to_the_plain_loss():
    """``object_weight`` k: weights 1 + k·cover on the latent grid — exactly 1 where the object never is, above 1
    where it is, the first latent frame from pixel frame 0 alone — and a uniform weight gives the plain MSE."""
    from sdvg.models.dit import CausalWanTransformer
    from sdvg.toy.dit_train import DiTSpec, flow_loss, object_weight_map
    from sdvg.toy.world import object_cover, render

    gen = torch.Generator().manual_seed(3)
    scenes = [sample_scene(gen) for _ in range(2)]
    w = object_weight_map(scenes, 4.0)
    assert w.shape == (2, 1, 9, 8, 8) and float(w.min()) == 1.0 and float(w.max()) <= 5.0
    cover = object_cover(scenes[0])
    frame0 = torch.nn.functional.avg_pool2d(cover[:1], 8)[0]
    assert torch.equal(w[0, 0, 0], 1 + 4.0 * frame0)
    # the cover is the render's: background pixels where it is 0, the object's colour where it is 1
    pixels = render(scenes[0])
    assert torch.equal(pixels[cover == 1][:, 0], torch.full_like(pixels[cover == 1][:, 0], pixels[cover == 1][0, 0]))
    assert (w > 1).any() and (w == 1).float().mean() > 0.5  # the object is a small part of the frame
    # the edge term: 0 in cells wholly outside or inside, its full weight where the outline halves a cell
    edged = object_weight_map(scenes, 0.0, edge=2.0)
    c = (w - 1) / 4.0
    torch.testing.assert_close(edged, 1 + 8.0 * c * (1 - c))
    assert torch.equal(edged[c == 0], torch.ones_like(edged[c == 0]))
    assert float(edged.max()) <= 3.0 and float(edged.max()) > 2.5

    torch.manual_seed(0)
    model = CausalWanTransformer(**DiTSpec(heads=1, head_dim=32, ffn=64, layers=1, patch=1).config()).float()
    x0, embeds = torch.randn(2, 16, 9, 8, 8), torch.randn(2, 8, 64)
    plain = flow_loss(model, x0, embeds, 1, torch.Generator().manual_seed(1))
    uniform = flow_loss(model, x0, embeds, 1, torch.Generator().manual_seed(1), torch.full((2, 1, 9, 8, 8), 3.0))
    weighted = flow_loss(model, x0, embeds, 1, torch.Generator().manual_seed(1), w)
    torch.testing.assert_close(uniform, plain, rtol=1e-6, atol=0)
    assert not torch.isclose(weighted, plain)


def test_a_toy_tree_declares_how_its_drafter_samples(tmp_path):
    """The stamp's ``drafter_sampling`` (a distilled student's own schedule and fresh noise) is the CLI's and the
    toy sampler's default for the tree's drafter — not for a drafter file given on the command line, not with
    --refine-from-step (one schedule for both), and never over an explicit --drafter-schedule."""
    import json
    import shutil

    from sdvg.cli.args import model_source, sampler_config_from_args
    from sdvg.cli.commands import build_parser
    from sdvg.toy import TOY_DIR, toy_drafter_sampling
    from sdvg.toy.sheet import toy_sampler_config

    tree = tmp_path / "toy"
    shutil.copytree(TOY_DIR, tree, ignore=shutil.ignore_patterns("*.pt", "*.safetensors"))
    stamp = json.loads((tree / "sdvg_toy.json").read_text())
    stamp["drafter_sampling"] = {"schedule": "diagonal", "step_noise": "fresh"}
    (tree / "sdvg_toy.json").write_text(json.dumps(stamp))
    assert toy_drafter_sampling(tree) == {"schedule": "diagonal", "step_noise": "fresh"}

    def config(*extra):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--out", str(tmp_path / "v.mp4"), "--models",
                                          str(tree), *extra])
        source = model_source(args)
        return sampler_config_from_args(args, source.preset, drafter=source.drafter_sampling)

    cfg = config()
    assert cfg.drafter_schedule == "diagonal" and cfg.drafter_step_noise == "fresh"
    assert [len(r) for r in cfg.step_schedule("drafter")] == [4, 3, 2] and len(cfg.step_schedule()[0]) == 10
    assert config("--drafter", str(tmp_path / "other.pt")).drafter_schedule is None
    assert config("--refine-from-step", "2").drafter_schedule is None
    assert config("--drafter-schedule", "constant", "--drafter-step-noise", "predicted").drafter_step_noise == "predicted"
    assert toy_sampler_config(models_dir=tree).drafter_schedule == "diagonal"
    del stamp["drafter_sampling"]
    (tree / "sdvg_toy.json").write_text(json.dumps(stamp))
    assert toy_drafter_sampling(tree) == {} and config().drafter_schedule is None


def test_a_tree_stamp_names_the_file_of_each_role(tmp_path):
    """A tree holding two drafters (the toy world's flow-matching one beside its student) loads the one its stamp
    names, not the first by name hints; without a stamp entry the hints still decide."""
    import json

    from sdvg.loaders.bundle import find_model_file

    (tmp_path / "diffusion_models").mkdir()
    for name in ("sdvg_toy_drafter.pt", "sdvg_toy_student.pt"):
        (tmp_path / "diffusion_models" / name).write_bytes(b"")
    assert find_model_file(tmp_path, "drafter").name == "sdvg_toy_drafter.pt"
    (tmp_path / "sdvg_toy.json").write_text(json.dumps({"files": {"drafter": "diffusion_models/sdvg_toy_student.pt"}}))
    assert find_model_file(tmp_path, "drafter").name == "sdvg_toy_student.pt"


def test_the_critic_s_contrast_captions_change_one_attribute_and_rank_by_ground_truth():
    """The ranking term's pairs: the contrast caption differs from the scene's caption in one attribute (the shape
    half the time), and the sign says which caption matches the rendered scene better — from the scene, never the
    judge."""
    from sdvg.loaders.vae_open import open_vae
    from sdvg.toy import TOY_DIR
    from sdvg.toy.critic_train import contrast_caption, make_batch

    gen = torch.Generator().manual_seed(0)
    changed = []
    for caption in all_captions()[:120]:
        other, name = contrast_caption(gen, caption)
        a, b = parse_caption(caption), parse_caption(other)
        assert [k for k in a if a[k] != b[k]] == [name] and name != "direction"
        changed.append(name)
    assert 0.35 < changed.count("shape") / len(changed) < 0.65 and {"colour", "background"} <= set(changed)
    vae = open_vae(TOY_DIR / "vae" / "sdvg_toy_patch_vae.safetensors", device="cpu", dtype="fp32")
    frames, captions, labels, others, signs = make_batch(torch.Generator().manual_seed(1), 24, vae, contrast=True)
    assert frames.shape == (24, 64, 64, 3) and len(captions) == len(others) == 24 and signs.shape == (24,)
    assert set(signs.tolist()) <= {-1.0, 0.0, 1.0} and (signs == 1).sum() >= 8  # ~half are the scene's own: they win
    for caption, other, sign in zip(captions, others, signs.tolist(), strict=True):
        if sign == 0:
            continue
        words = lambda c: {v for k, v in parse_caption(c).items() if k != "direction"}  # noqa: E731
        assert words(caption) != words(other)


def test_the_toy_pair_is_not_taken_for_swapped_files(caplog):
    """The student is distilled from the target into itself (1.21 M parameters each, patch 1×1): the same forward,
    cheaper only by its steps, so the swapped-files warning (parameters weighed by tokens, larger only) stays
    silent."""
    from sdvg.loaders.bundle import forward_work, inspect_dits, warn_if_drafter_larger
    from sdvg.toy.preset import toy_files

    infos = inspect_dits(toy_files())
    assert infos["drafter"].num_params == infos["target"].num_params
    assert forward_work(infos["drafter"]) == forward_work(infos["target"])
    with caplog.at_level("WARNING"):
        warn_if_drafter_larger(infos)
    assert "larger than the target" not in caplog.text


def test_heldout_bench_pairs_a_dit_against_itself_to_exactly_zero(capsys, bench_script):
    """bench/toy_heldout.py --against: the same DiT on the same (caption, seed) pairs is the same video, so every
    paired difference is exactly 0 and both summaries agree (the comparison runs both models on one noise)."""
    from sdvg.toy import TOY_DIR

    mod = bench_script("toy_heldout")
    dit = str(TOY_DIR / "diffusion_models" / "sdvg_toy_target.safetensors")
    assert mod.main(["--dit", dit, "--against", dit, "--captions", "1", "--seeds", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in report["against"].items() if k not in ("dit", "models", "step_noise")} == \
        {k: report[k] for k in report["paired_difference"]}
    assert all(v == [0.0, 0.0, 0.0] for v in report["paired_difference"].values())
    assert 0.0 <= report["judge"][0] <= 1.0
    assert mod.main(["--dit", dit, "--against", dit, "--captions", "1", "--seeds", "0", "--step-noise", "fresh",
                     "--against-step-noise", "predicted"]) == 0  # one DiT, two sampler settings: other videos
    report = json.loads(capsys.readouterr().out)
    assert (report["step_noise"], report["against"]["step_noise"]) == ("fresh", "predicted")
    assert any(report[k] != report["against"][k] for k in report["paired_difference"])


def test_the_finetune_bench_makes_a_tree_with_its_settings_in_the_stamp(tmp_path, bench_script):
    """bench/toy_finetune_target.py: from the committed target, 1 step of the object- and edge-weighted loss gives a
    new target in a new tree (the base is not touched), and the stamp records the settings it ran with."""
    from sdvg.loaders.wan import load_dit
    from sdvg.toy import TOY_DIR

    mod = bench_script("toy_finetune_target")
    base = TOY_DIR / "diffusion_models" / "sdvg_toy_target.safetensors"
    before = base.read_bytes()
    out = tmp_path / "ft"
    assert mod.main(["--base", str(base), "--out", str(out), "--steps", "1", "--batch", "1", "--seed", "5",
                     "--object-weight", "4", "--edge-weight", "2"]) == 0
    assert base.read_bytes() == before
    new = out / "diffusion_models" / "sdvg_toy_target.safetensors"
    settings = json.loads((out / "sdvg_toy.json").read_text())["stages"]["target_ft"]["settings"]
    assert (settings["steps"], settings["seed"], settings["object_weight"], settings["edge_weight"]) == (1, 5, 4.0, 2.0)
    a, b = load_dit(base, dtype="fp32", device="cpu").state_dict(), load_dit(new, dtype="fp32", device="cpu").state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_the_finetune_bench_trains_a_target_from_scratch_in_another_head_layout(tmp_path, bench_script, capsys):
    """bench/toy_finetune_target.py --scratch: the target stage from random weights with the heads changed (4 × 32
    instead of 2 × 64, the same width); the file loads with 4 heads, its EMA export is in the tree's checkpoints, the
    stamp records the spec and settings; --heads without --scratch is refused (exit 2) before anything is written.
    With --vae it trains in that file's units (the tree holds it); --base-vae has no base to name and is refused."""
    from safetensors.torch import load_file

    from sdvg.loaders.patch_vae import write_patch_vae
    from sdvg.loaders.wan import load_dit
    from sdvg.toy import TOY_DIR
    from sdvg.toy.train import FILES

    mod = bench_script("toy_finetune_target")
    out = tmp_path / "scratch"
    assert mod.main(["--scratch", "--heads", "4", "--head-dim", "32", "--out", str(out), "--steps", "1", "--batch",
                     "2", "--seed", "7", "--object-weight", "8"]) == 0
    model = load_dit(out / "diffusion_models" / "sdvg_toy_target.safetensors", dtype="fp32", device="cpu")
    assert (model.num_heads, model.head_dim) == (4, 32)
    assert (out / "checkpoints" / "sdvg_toy_target.safetensors").is_file()
    stage = json.loads((out / "sdvg_toy.json").read_text())["stages"]["target"]
    assert (stage["spec"]["heads"], stage["spec"]["head_dim"], stage["steps"]) == (4, 32, 1)
    assert (stage["settings"]["seed"], stage["settings"]["object_weight"]) == (7, 8.0)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--base", str(out / "diffusion_models" / "sdvg_toy_target.safetensors"), "--heads", "4",
                  "--out", str(tmp_path / "no")])
    assert exc.value.code == 2 and "need --scratch" in capsys.readouterr().err and not (tmp_path / "no").exists()
    tensors = load_file(str(TOY_DIR / FILES["vae"]))
    units = tmp_path / "units.safetensors"
    write_patch_vae(dict(tensors, latents_std=tensors["latents_std"] * torch.linspace(2.0, 0.5, 16)), units)
    assert mod.main(["--scratch", "--vae", str(units), "--out", str(tmp_path / "w"), "--steps", "1", "--batch", "2"]) == 0
    assert (tmp_path / "w" / FILES["vae"]).read_bytes() == units.read_bytes()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--scratch", "--vae", str(units), "--base-vae", str(units), "--out", str(tmp_path / "no")])
    assert exc.value.code == 2 and "no base" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_the_whitened_vae_carries_the_target_over_to_per_channel_units(tmp_path, bench_script, capsys):
    """bench/toy_whiten_vae.py keeps the committed bases and sets one std per channel (measured, so the first
    component's is the largest); toy_finetune_target.py --vae puts that file in the new tree and starts from the
    committed target rescaled by new std / old std (``rescaled_channels``); a VAE with other bases is refused."""
    from safetensors.torch import load_file

    from sdvg.fixtures.tiny import write_krea_safetensors
    from sdvg.loaders.patch_vae import write_patch_vae
    from sdvg.loaders.wan import load_dit
    from sdvg.toy import TOY_DIR
    from sdvg.toy.dit_train import original_state_dict, rescaled_channels
    from sdvg.toy.train import BASE_TARGET, FILES

    old_vae = TOY_DIR / FILES["vae"]
    white = tmp_path / "white.safetensors"
    assert bench_script("toy_whiten_vae").main(["--out", str(white), "--clips", "8"]) == 0
    old, new = load_file(str(old_vae)), load_file(str(white))
    assert all(torch.equal(old[k], new[k]) for k in ("first.basis", "group.basis", "first.mean", "group.mean"))
    std = new["latents_std"]
    assert int(std.argmax()) == 0 and float(std[0] / std[-1]) > 5 and len(set(old["latents_std"].tolist())) == 1

    base = TOY_DIR / FILES["target"]
    out = tmp_path / "ft"
    mod = bench_script("toy_finetune_target")
    assert mod.main(["--base", str(base), "--out", str(out), "--steps", "1", "--batch", "1", "--vae", str(white)]) == 0
    assert (out / FILES["vae"]).read_bytes() == white.read_bytes()
    want = tmp_path / "want.safetensors"
    write_krea_safetensors(want, original_state_dict(rescaled_channels(load_dit(base, dtype="fp32", device="cpu"),
                                                                       std / old["latents_std"])), 2)
    started = load_dit(tmp_path / "ft_work" / BASE_TARGET, dtype="fp32", device="cpu").state_dict()
    assert all(torch.equal(v, started[k]) for k, v in load_dit(want, dtype="fp32", device="cpu").state_dict().items())
    other = dict(new, **{"group.basis": new["group.basis"].flip(0)})
    write_patch_vae(other, tmp_path / "other.safetensors")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--base", str(base), "--out", str(tmp_path / "ft2"), "--steps", "1", "--vae",
                  str(tmp_path / "other.safetensors")])
    assert exc.value.code == 2 and "different bases" in capsys.readouterr().err and not (tmp_path / "ft2").exists()


def test_the_swap_probe_measures_how_much_the_target_relies_on_each_word(bench_script):
    """bench/toy_shape_probe.py's swap probe: the caption and its 12 one-word swaps (each differs from it in exactly
    the swapped attribute), and per attribute the loss rise of the swapped word beside the rise of drawing it; the
    committed target relies on the background word far more than on the shape word. The text probe: a linear read of
    the shape word from one token, fitted on training captions, is right on held-out ones."""
    from sdvg.loaders import load_models
    from sdvg.toy import TOY_DIR
    from sdvg.toy.world import ATTRIBUTES, held_out_captions, parse_caption

    mod = bench_script("toy_shape_probe")
    caption = held_out_captions(1)[0]
    scene = sample_scene(torch.Generator().manual_seed(0), frames=9, caption=caption)
    swaps = mod._swaps(scene, caption)
    assert len(swaps) == 13 and swaps[caption] == (None, None)
    for c, (attr, word) in swaps.items():
        if attr:
            diff = {k for k in ATTRIBUTES if parse_caption(c)[k] != parse_caption(caption)[k]}
            assert diff == {attr} and parse_caption(c)[attr] == word
    models = load_models(TOY_DIR, need=("target", "vae", "text_encoder"), dit_device="cpu", aux_device="cpu",
                         dtype="fp32")
    got = mod.swap_probe(models, [caption], 0, [0.5], scenes=1)
    assert set(got) == {f"0.5/{a}{x}" for a in ATTRIBUTES for x in ("", ":drawn")}
    assert got["0.5/background"] > 10 * abs(got["0.5/shape"]) and got["0.5/shape:drawn"] > 0
    text = mod.text_probe(models.text_encoder, positions=4)  # every word is linearly readable on held-out captions
    assert set(text) == set(ATTRIBUTES) and all(len(v["held_out_accuracy_by_position"]) == 4 for v in text.values())
    assert min(text["shape"]["held_out_accuracy_by_position"]) > 0.9 > text["shape"]["chance"]


def test_toy_train_merges_its_stages_into_a_tree_stamp(tmp_path):
    """Training a stage into a tree keeps what the stamp says of everything else: the student named as the drafter,
    its own sampling, provenance entries, other stages; a retrained drafter takes the role back (and drops the
    student's sampling, which was the student's, not the new drafter's)."""
    from sdvg.toy.train import FILES, ToyTrainConfig, _write_stamp

    student = "diffusion_models/sdvg_toy_student.pt"
    stamp = {"version": 1, "files": {**FILES, "drafter": student}, "stages": {"target": {"steps": 5}},
             "drafter_sampling": {"schedule": "diagonal", "step_noise": "fresh"}, "student": {"steps": 200}}
    (tmp_path / "sdvg_toy.json").write_text(json.dumps(stamp))
    _write_stamp(tmp_path, ToyTrainConfig(), {"critic": {"steps": 3}})
    got = json.loads((tmp_path / "sdvg_toy.json").read_text())
    assert got["files"]["drafter"] == student and got["drafter_sampling"] == stamp["drafter_sampling"]
    assert got["student"] == {"steps": 200} and set(got["stages"]) == {"target", "critic"}
    assert got["files"]["reward"] == FILES["reward"]
    _write_stamp(tmp_path, ToyTrainConfig(), {"drafter": {"steps": 4}})
    got = json.loads((tmp_path / "sdvg_toy.json").read_text())
    assert got["files"]["drafter"] == FILES["drafter"] and "drafter_sampling" not in got
    assert got["student"] == {"steps": 200} and set(got["stages"]) == {"target", "critic", "drafter"}
