"""The toy world's critic: a tiny ImageReward (BLIP ViT + BERT + MLP head, the official key layout) trained to score
one frame against a caption. The router uses it exactly as it uses ImageReward.

Training pairs are built from the world's ground truth only (never from the judge, so the two stay independent):
a render of a scene, possibly **corrupted** — noise in the patch latent space (what a weak DiT gets wrong), a faded
object, blur, pixel noise — and a caption that matches it or differs in some of the three attributes a frame shows
(background, colour, shape): half the captions are changed, each attribute with probability 1/2. The label is ``4·q − 2`` with ``q = (matching attributes / 3) · (1 − corruption)``,
regressed with an MSE on the model's reward (ImageReward's z-score scale).

Each frame is also scored against a **contrast caption**, its own caption with one attribute changed (the shape half
the time, else the colour or the background), and a logistic ranking loss asks the caption that matches better to
score higher (``rank_weight``; 0 = the regression alone). The regression alone learnt colour and background but
not shape: a frame's shape moves its label as much as its colour does, but the colour is far easier to see, and a
regression settles for it; the ranking pairs differ in nothing but the changed word.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.reward import ImageReward, ImageRewardConfig
from .world import BACKGROUNDS, OBJECT_COLOURS, SHAPES, caption_of, parse_caption, render, sample_scene

logger = logging.getLogger(__name__)

CRITIC_CONFIG = ImageRewardConfig(
    image_size=64, patch_size=8, vision_width=64, vision_depth=2, vision_heads=2, vision_intermediate=128,
    text_hidden=768, text_layers=1, text_heads=12, text_intermediate=32, vocab_size=0, max_position_embeddings=40,
)
TOY_WORDS = "circle square triangle moving left right up down black white background yellow".split()


def critic_vocab() -> list[str]:
    from ..fixtures.tiny import tiny_reward_vocab

    return list(dict.fromkeys([*tiny_reward_vocab(), *TOY_WORDS]))


def _swap(gen: torch.Generator, value: str, options) -> str:
    others = [o for o in options if o != value]
    return others[int(torch.randint(len(others), (), generator=gen))]


def _corrupt(gen: torch.Generator, frame: torch.Tensor, vae) -> tuple[torch.Tensor, float]:
    """A corrupted copy of ``frame [H,W,3]`` and its corruption strength in [0, 1]."""
    kind = int(torch.randint(5, (), generator=gen))
    c = float(torch.rand((), generator=gen))
    if kind == 0:
        return frame, 0.0
    if kind == 1:  # latent noise: what an imperfect DiT decodes to
        z = vae.encode_frame(frame[None])
        z = z + 1.5 * c * torch.randn(z.shape, generator=gen)
        vae.reset()
        return vae.decode_block(z)[0], c
    if kind == 2:  # the object fades into the background
        bg = frame[:2, :2].reshape(-1, 3).median(0).values
        return frame * (1 - c) + bg * c, c
    if kind == 3:  # blur
        k = 1 + 2 * int(c * 4)
        x = frame.permute(2, 0, 1)[None]
        return F.avg_pool2d(x, k, 1, k // 2, count_include_pad=False)[0].permute(1, 2, 0), c * 0.8
    noisy = (frame + 0.6 * c * torch.randn(frame.shape, generator=gen)).clamp(0, 1)
    return noisy, c


def contrast_caption(gen: torch.Generator, caption: str) -> tuple[str, str]:
    """``caption`` with one attribute changed (shape with probability 1/2, else colour or background) → (caption,
    the attribute changed)."""
    attrs = parse_caption(caption)
    u = float(torch.rand((), generator=gen))
    name, options = (("shape", SHAPES) if u < 0.5 else ("colour", OBJECT_COLOURS) if u < 0.75
                     else ("background", BACKGROUNDS))
    attrs[name] = _swap(gen, attrs[name], options)
    return caption_of(attrs["colour"], attrs["shape"], attrs["direction"], attrs["background"]), name


def make_batch(gen: torch.Generator, n: int, vae, *, contrast: bool = False):
    """``n`` (frame, caption, label) examples → (frames, captions, labels); with ``contrast``, also each frame's
    contrast caption and whether the frame's own caption matches it better (captions, sign ∈ {−1, 0, +1})."""
    frames, captions, labels, others, signs = [], [], [], [], []
    for _ in range(n):
        scene = sample_scene(gen)
        t = int(torch.randint(33, (), generator=gen))
        frame = render(scene, 1, start=t)[0]
        frame, corruption = _corrupt(gen, frame, vae)
        attrs = {"background": scene.background, "colour": scene.colour, "shape": scene.shape}
        wrong = 0
        if float(torch.rand((), generator=gen)) < 0.5:  # half the captions: each attribute wrong with p = 1/2
            for name, options in (("background", BACKGROUNDS), ("colour", OBJECT_COLOURS), ("shape", SHAPES)):
                if float(torch.rand((), generator=gen)) < 0.5:
                    attrs[name] = _swap(gen, attrs[name], options)
                    wrong += 1
        captions.append(caption_of(attrs["colour"], attrs["shape"], scene.direction, attrs["background"]))
        frames.append(frame)
        labels.append(4.0 * (3 - wrong) / 3 * (1 - corruption) - 2.0)
        if contrast:
            other, _ = contrast_caption(gen, scene.caption)
            others.append(other)
            # the contrast caption matches the scene in 2 of its 3 visible attributes, the caption in 3 − wrong
            signs.append(float((wrong < 1) - (wrong > 1)))
    if contrast:
        return torch.stack(frames), captions, torch.tensor(labels), others, torch.tensor(signs)
    return torch.stack(frames), captions, torch.tensor(labels)


def build_critic(seed: int) -> ImageReward:
    from ..loaders.reward import load_tokenizer

    vocab = critic_vocab()
    cfg = ImageRewardConfig(**{**{f.name: getattr(CRITIC_CONFIG, f.name) for f in fields(CRITIC_CONFIG)},
                               "vocab_size": len(vocab) + 2})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.txt"
        path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
        tokenizer = load_tokenizer(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ImageReward(cfg, tokenizer)
    return model


def train_critic(paths: dict[str, Path], cfg, work: Path, *, progress: Callable[[dict], None] | None = None,
                 batch: int = 32, lr: float = 3e-4) -> Path:
    """Train the critic for ``cfg.critic_steps`` steps and write it to ``paths["reward"]`` (+ vocab, config)."""
    from ..loaders.vae_open import open_vae

    vae = open_vae(paths["vae"], device="cpu", dtype="fp32")
    model = build_critic(cfg.seed + 3)
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    t0 = time.perf_counter()
    losses = []
    for step in range(cfg.critic_steps):
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)
        rank = cfg.critic_rank_weight > 0
        frames, captions, labels, *contrast = make_batch(gen, batch, vae, contrast=rank)
        others = contrast[0] if rank else []
        prompts = [model.prepare_prompt(c) for c in [*captions, *others]]
        ids = torch.cat([p.input_ids for p in prompts])
        mask = torch.cat([p.attention_mask for p in prompts])
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        pixels = model.preprocess(frames)
        scores = model.rewards(pixels.repeat(2, 1, 1, 1) if rank else pixels, ids, mask)
        loss = F.mse_loss(scores[:batch], labels)
        if rank:  # the better-matching caption of each pair scores higher (pairs that match equally: no term)
            sign = contrast[1]
            rank_loss = (F.softplus(-sign * (scores[:batch] - scores[batch:]) * 2.0) * sign.abs()).sum()
            loss = loss + cfg.critic_rank_weight * rank_loss / sign.abs().sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress({"role": "critic", "step": step + 1, "steps": cfg.critic_steps, "loss": losses[-1],
                      "s_per_step": (time.perf_counter() - t0) / (step + 1)})
    (work / "critic_losses.json").write_text(json.dumps(losses), encoding="utf-8")
    return write_critic(model, paths["reward"])


def write_critic(model: ImageReward, path: Path) -> Path:
    """The critic in the official ImageReward.pt key layout (fp16 tensors: the file stays under 10 MB), with its
    ``.vocab.txt`` and ``.config.json`` beside it."""
    from ..fixtures.tiny import official_reward_state_dict

    path.parent.mkdir(parents=True, exist_ok=True)
    half = {name: {k: v.detach().half() if v.is_floating_point() else v for k, v in m.state_dict().items()}
            for name, m in (("vision", model.vision), ("text", model.text), ("mlp", model.mlp))}
    half["text"].pop("embeddings.position_ids", None)
    state = official_reward_state_dict(half["vision"], half["text"], half["mlp"], model.config)
    state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(state, path)
    path.with_name(path.stem + ".vocab.txt").write_text("\n".join(critic_vocab()) + "\n", encoding="utf-8")
    path.with_name(path.stem + ".config.json").write_text(
        json.dumps({"vision_heads": model.config.vision_heads, "text_heads": model.config.text_heads,
                    "note": "sdvg toy-world critic, trained by python -m sdvg toy train"}) + "\n", encoding="utf-8")
    return path
