"""Where the toy target loses the caption's shape (issue 24, goal 1): four probes of one target file.

    python bench/toy_shape_probe.py                                   # the committed target, default sampling
    python bench/toy_shape_probe.py --step-noise predicted --schedule "[[1000,900,800,700,600,500,400,300,200,100]]"
    python bench/toy_shape_probe.py --dit out/ft/diffusion_models/sdvg_toy_target.safetensors --probe words

- ``words``: for ``--captions`` held-out captions, the same seed with each of the three shape words (the other
  attributes kept): the judge's shape reading per asked shape (a confusion count), its shape accuracy, and how much
  the shape word changes the video (pixel MSE between shape words) against how much the seed does (same caption,
  the next seed).
- ``noised``: renders of held-out captions' scenes (one block, 9 pixel frames) noised to σ and denoised by Euler
  steps of the flow ODE with the render's own shape word or another: how often the judge reads the asked word's shape
  and how often the render's shape survives — whether the model *draws* a shape word or only keeps the shape it is
  shown.
- ``swap``: renders of held-out captions' scenes (one block, no context) noised to σ, the flow loss with the
  caption's own words and with one attribute's word swapped for each other value (same noise): the relative rise in
  loss per attribute and σ — how much the model's prediction relies on that word (0: not at all) — and, as its
  scale (``<attr>:drawn``), the rise a model would show that drew the swapped word exactly in place (the latent MSE
  between the scene and the same scene with the other word, over the own word's loss).
- ``text``: whether the text encoder's output carries each attribute where the DiT can read it: a ridge
  classifier on one token position's embedding (each of the first 12), fitted on the 144 training captions, its
  accuracy on the 72 held-out ones.
- ``guided``: one block from noise by 10 ODE steps, the velocity pushed away from the other two shape words'
  (v + w·(v − mean of v for the other shape words), w in ``--weights``; a probe of whether the model's shape-word
  dependence points at the asked shape, not a sampler option: the engine samples without guidance, as Krea and
  Self-Forcing do).

Prints one JSON line. Sampling: target-only, the toy world's settings unless ``--schedule`` / ``--step-noise``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dit", default=None, help="a toy target file (default: the committed one)")
    p.add_argument("--probe", choices=("words", "noised", "guided", "swap", "text", "both"), default="both",
                   help="both: words and noised")
    p.add_argument("--captions", type=int, default=12, help="held-out captions (spread over all 72)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default=None, help="JSON per-block lists (default: the toy schedule)")
    p.add_argument("--step-noise", default=None, help="fresh | predicted (default: the toy world's)")
    p.add_argument("--sigmas", default="0.3,0.5,0.7,1.0", help="the noised probe's noise levels")
    p.add_argument("--weights", default="0,2,5", help="the guided probe's weights w")
    p.add_argument("--models", default=None, help="models tree for VAE and text encoder (default: the committed one)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from sdvg.loaders import load_models
    from sdvg.toy import TOY_DIR
    from sdvg.toy.world import held_out_captions

    models = load_models(a.models or TOY_DIR, target=a.dit, need=("target", "vae", "text_encoder"),
                         dit_device="cpu", aux_device="cpu", dtype="fp32")
    caps = held_out_captions(a.captions)
    report = {"dit": a.dit or "committed", "captions": len(caps), "seed": a.seed}
    if a.probe in ("words", "both"):
        report["words"] = words_probe(models, caps, a.seed, a.schedule, a.step_noise)
    if a.probe in ("noised", "both"):
        report["noised"] = noised_probe(models, caps, a.seed, [float(s) for s in a.sigmas.split(",")])
    if a.probe == "swap":
        report["swap"] = swap_probe(models, caps, a.seed, [float(s) for s in a.sigmas.split(",")])
    if a.probe == "text":
        report["text"] = text_probe(models.text_encoder)
    if a.probe == "guided":
        report["guided"] = {w: guided_probe(models, caps, a.seed, float(w)) for w in a.weights.split(",")}
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


def _video(models, caption: str, seed: int, schedule, step_noise) -> torch.Tensor:
    from sdvg.sampling.router import RouterConfig
    from sdvg.sampling.sampler import SpeculativeSampler
    from sdvg.toy.sheet import toy_sampler_config

    cfg = toy_sampler_config(seed=seed, step_noise=step_noise)
    if schedule is not None:
        cfg = dataclasses.replace(cfg, schedule=json.loads(schedule)).validate()
    frames = SpeculativeSampler(models, RouterConfig(mode="target-only"), cfg).run(caption).frames
    return frames.float() / 255.0 if frames.dtype == torch.uint8 else frames.float()


def _variants(caption: str) -> dict[str, str]:
    from sdvg.toy.world import SHAPES, caption_of, parse_caption

    a = parse_caption(caption)
    return {s: caption_of(a["colour"], s, a["direction"], a["background"]) for s in SHAPES}


def words_probe(models, caps: list[str], seed: int, schedule, step_noise) -> dict:
    from sdvg.toy.judge import judge

    confusion, right, word_mse, seed_mse = collections.Counter(), [], [], []
    for caption in caps:
        vids = {}
        for shape, asked in _variants(caption).items():
            vids[shape] = _video(models, asked, seed, schedule, step_noise)
            got = judge(vids[shape], asked).attributes["shape"]
            confusion[f"{shape}->{got}"] += 1
            right.append(got == shape)
        shapes = list(vids)
        word_mse += [float((vids[x] - vids[y]).square().mean()) for i, x in enumerate(shapes) for y in shapes[i + 1:]]
        other = _video(models, _variants(caption)[shapes[0]], seed + 1, schedule, step_noise)
        seed_mse.append(float((vids[shapes[0]] - other).square().mean()))
    return {"shape_accuracy": sum(right) / len(right), "videos": len(right), "confusion": dict(sorted(confusion.items())),
            "mse_between_shape_words": sum(word_mse) / len(word_mse), "mse_between_seeds": sum(seed_mse) / len(seed_mse),
            "schedule": schedule or "toy", "step_noise": step_noise or "toy"}


@torch.no_grad()
def _euler(dit, x: torch.Tensor, ctx: torch.Tensor, sigmas, negs: tuple = (), w: float = 0.0) -> torch.Tensor:
    """Euler steps of the flow ODE from ``x`` through the noise levels ``sigmas`` (0..1, falling); with ``w`` the
    velocity is pushed away from the mean velocity under the contexts ``negs``: v + w·(v − v_negs)."""
    for hi, lo in zip(sigmas, sigmas[1:], strict=False):
        t = torch.full((1, x.shape[2]), float(hi) * 1000)
        v = dit.forward_train(x, t, ctx)
        if w:
            v = v + w * (v - sum(dit.forward_train(x, t, n) for n in negs) / len(negs))
        x = x + (float(lo) - float(hi)) * v
    return x


def noised_probe(models, caps: list[str], seed: int, sigmas: list[float], steps: int = 6) -> dict:
    from sdvg.toy.judge import judge
    from sdvg.toy.world import render, sample_scene

    dit, vae, te = models.target.eval(), models.vae, models.text_encoder
    gen = torch.Generator().manual_seed(seed)
    hits = collections.defaultdict(list)
    for caption in caps:
        scene = sample_scene(gen, frames=9, caption=caption)
        x0 = vae.encode_video(render(scene, 9))
        for sigma in sigmas:
            for shape, asked in _variants(scene.caption).items():
                eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
                x = _euler(dit, (1 - sigma) * x0 + sigma * eps, dit.cross_attention(te.encode(asked).float()),
                           torch.linspace(sigma, 0.0, steps + 1).tolist())
                vae.reset()
                got = judge(vae.decode_block(x), asked).attributes["shape"]
                if shape == scene.shape:
                    hits[f"{sigma}/asked_own_shape"].append(got == shape)
                else:
                    hits[f"{sigma}/asked_other:drew_asked"].append(got == shape)
                    hits[f"{sigma}/asked_other:kept_render"].append(got == scene.shape)
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())} | {"ode_steps": steps}


def swap_probe(models, caps: list[str], seed: int, sigmas: list[float], scenes: int = 2) -> dict:
    from sdvg.toy.world import render, sample_scene

    dit, vae, te = models.target.eval(), models.vae, models.text_encoder
    gen = torch.Generator().manual_seed(seed)
    ctx: dict[str, torch.Tensor] = {}
    rise = collections.defaultdict(list)
    with torch.no_grad():
        for caption in caps:
            for _ in range(scenes):
                scene = sample_scene(gen, frames=9, caption=caption)
                x0 = vae.encode_video(render(scene, 9))
                swaps = _swaps(scene, caption)
                drawn = {c: float((vae.encode_video(render(dataclasses.replace(scene, **{attr: word}), 9)) - x0)
                                  .square().mean()) for c, (attr, word) in swaps.items() if attr}
                for sigma in sigmas:
                    eps = torch.randn(x0.shape, generator=gen)
                    x, t = (1 - sigma) * x0 + sigma * eps, torch.full((1, x0.shape[2]), sigma * 1000)
                    losses = {c: _flow_error(dit, x, t, eps - x0, ctx.setdefault(
                        c, dit.cross_attention(te.encode(c).float()))) for c in swaps}
                    for c, (attr, _) in swaps.items():
                        if attr:
                            rise[f"{sigma}/{attr}"].append(losses[c] / losses[caption] - 1)
                            rise[f"{sigma}/{attr}:drawn"].append(drawn[c] / losses[caption])
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(rise.items())}


def _swaps(scene, caption: str) -> dict[str, tuple[str | None, str | None]]:
    """The caption (``(None, None)``) and every caption with one attribute's word swapped: ``(attribute, word)``."""
    from sdvg.toy.world import ATTRIBUTES, BACKGROUNDS, DIRECTIONS, OBJECT_COLOURS, SHAPES, caption_of

    values = {"background": BACKGROUNDS, "colour": OBJECT_COLOURS, "shape": SHAPES, "direction": DIRECTIONS}
    words = {k: getattr(scene, k) for k in ATTRIBUTES}
    out: dict[str, tuple[str | None, str | None]] = {caption: (None, None)}
    for attr in ATTRIBUTES:
        for other in values[attr]:
            if other != words[attr]:
                out[caption_of(**{**words, attr: other})] = (attr, other)
    return out


def _flow_error(dit, x: torch.Tensor, t: torch.Tensor, target: torch.Tensor, context: torch.Tensor) -> float:
    return float((dit.forward_train(x, t, context).float() - target).square().mean())


def text_probe(te, positions: int = 12, ridge: float = 0.1) -> dict:
    from sdvg.toy.world import ATTRIBUTES, held_out_captions, parse_caption, train_captions

    split = {"train": train_captions(), "held_out": held_out_captions()}
    with torch.no_grad():
        tokens = {k: torch.stack([te.encode(c).float()[0, :positions] for c in caps]) for k, caps in split.items()}
    out = {}
    for attr in ATTRIBUTES:
        values = sorted({parse_caption(c)[attr] for c in split["train"]})
        label = {k: torch.tensor([values.index(parse_caption(c)[attr]) for c in caps]) for k, caps in split.items()}
        accuracy = []
        for p in range(positions):
            x = {k: torch.cat([t[:, p], torch.ones(len(t), 1)], 1) for k, t in tokens.items()}
            y = torch.nn.functional.one_hot(label["train"], len(values)).float()
            w = torch.linalg.solve(x["train"].T @ x["train"] + ridge * torch.eye(x["train"].shape[1]), x["train"].T @ y)
            accuracy.append(round(float(((x["held_out"] @ w).argmax(1) == label["held_out"]).float().mean()), 3))
        out[attr] = {"chance": round(1 / len(values), 3), "held_out_accuracy_by_position": accuracy}
    return out


GUIDED_SIGMAS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)  # 10 ODE steps from pure noise


def guided_probe(models, caps: list[str], seed: int, w: float) -> dict:
    from sdvg.toy.judge import judge

    dit, vae, te = models.target.eval(), models.vae, models.text_encoder
    ctx = {}
    confusion, right, valid = collections.Counter(), [], []
    for caption in caps:
        variants = _variants(caption)
        for asked in variants.values():
            ctx.setdefault(asked, dit.cross_attention(te.encode(asked).float()))
        for shape, asked in variants.items():
            negs = [ctx[c] for s, c in variants.items() if s != shape]
            vae.reset()
            x = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
            verdict = judge(vae.decode_block(_euler(dit, x, ctx[asked], GUIDED_SIGMAS, negs, w)), asked)
            confusion[f"{shape}->{verdict.attributes['shape']}"] += 1
            right.append(verdict.attributes["shape"] == shape)
            valid.append(verdict.valid)
    return {"shape_accuracy": sum(right) / len(right), "valid": sum(valid) / len(valid),
            "confusion": dict(sorted(confusion.items()))}


if __name__ == "__main__":
    raise SystemExit(main())
