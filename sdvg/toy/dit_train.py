"""Flow-matching training of one causal DiT on the toy world (the toy target and drafter).

The training forward is the project's own ``CausalWanTransformer.forward_train`` (block-causal mask over a clip).
Each step draws fresh scenes (seeded by the step, so a resumed run sees the same data), encodes them with the patch
latent model and trains on one noisy block after 0–2 *clean* blocks of context, the way the sampler runs: its
cache holds the earlier blocks re-run at t = 0. The noisy block gets one σ ~ U(0, 1) per clip and the loss is the
MSE of the predicted flow ``ε − x0`` on that block. An EMA of the weights (decay warmed up to ``ema``,
:func:`ema_decay`) is what gets exported.

State (``state_<role>.pt``: weights, EMA, optimiser, step, losses) is written every ``save_every`` steps and at the
end, so ``train`` resumes where a run stopped.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..loaders.checkpoint import torch_load
from ..loaders.wan_keys import make_config, to_original_keys
from ..models.dit import CausalWanTransformer
from ..models.patch_vae import PatchVAE
from .world import CLIP_FRAMES, Scene, object_cover, render_batch, render_shape_pairs, train_captions

logger = logging.getLogger(__name__)

CONTEXT_BLOCKS = (0.5, 0.3, 0.2)  # probability of 0, 1, 2 clean blocks before the noisy one


@dataclass
class DiTSpec:
    """The shape of a toy DiT (dim = heads × head_dim)."""

    heads: int
    head_dim: int
    ffn: int
    layers: int
    text_dim: int = 64
    patch: int = 2  # spatial patch: 2 → 16 tokens a frame on the 8×8 latent, 1 → 64

    def config(self) -> dict:
        p = (1, self.patch, self.patch)
        return make_config(self.heads, self.head_dim, 16, 16, self.text_dim, 64, self.ffn, self.layers, p)


@dataclass
class DiTTrainSettings:
    steps: int = 4000
    batch: int = 16
    lr: float = 4e-4
    warmup: int = 100
    ema: float = 0.998
    seed: int = 0
    save_every: int = 250
    weight_decay: float = 0.01
    object_weight: float = 0.0  # k in the loss weight 1 + k·c + e·4c(1 − c), c the object cover of the latent cell
    edge_weight: float = 0.0  # e: the cells the object's outline crosses (where shapes differ); 0, 0 = plain MSE
    shape_pairs: bool = False  # batches of scene pairs that differ only in shape, sharing noise, σ and context
    shape_contrast: float = 0.0  # λ < 1: minus λ × the error against the partner's target (needs shape_pairs)

    def __post_init__(self) -> None:
        if not 0.0 <= self.shape_contrast < 1.0:
            raise ConfigError(f"shape_contrast must be in [0, 1), got {self.shape_contrast} (at 1 the loss has no "
                              "minimum).")
        if self.shape_contrast and not self.shape_pairs:
            raise ConfigError("shape_contrast needs shape_pairs: the contrast is against the pair's other shape.")
        if self.shape_pairs and self.batch % 2:
            raise ConfigError(f"shape_pairs needs an even batch, got {self.batch}.")


def build_dit(spec: DiTSpec, seed: int) -> CausalWanTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CausalWanTransformer(**spec.config())
    return model.float().train()


def deepened(base: CausalWanTransformer, spec: DiTSpec, seed: int) -> CausalWanTransformer:
    """``base`` with blocks appended up to ``spec.layers``: each new block is a fresh one (``seed``) whose three output
    projections (self-attention, cross-attention, FFN) are zero, so it adds nothing to the residual stream and the
    deeper model computes exactly what ``base`` does until training moves those projections off zero."""
    model = build_dit(spec, seed)
    have = len(base.blocks)
    if spec.layers < have:
        raise ConfigError(f"Deepening needs at least the base's {have} layers, got {spec.layers}.")
    try:
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        missing, unexpected = [], [str(exc).splitlines()[-1].strip()]
    stray = list(unexpected) + [k for k in missing if not k.startswith("blocks.") or int(k.split(".")[1]) < have]
    if stray:
        raise ConfigError(f"The base DiT differs from {spec} in more than its depth (e.g. {stray[0]}); deepen a "
                          "base of the same width, heads and patch.")
    with torch.no_grad():
        for blk in model.blocks[have:]:
            for out in (blk.attn1.to_out[0], blk.attn2.to_out[0], blk.ffn.net[2]):
                out.weight.zero_()
                out.bias.zero_()
    return model


def rescaled_channels(model: CausalWanTransformer, ratio: torch.Tensor) -> CausalWanTransformer:
    """``model`` (in place) for latents whose channel c is divided by ``ratio[c]`` (a new VAE normalisation: ratio =
    new ``latents_std`` / old): the patch embedding multiplies channel c's input weights by ``ratio[c]`` so it sees
    the clean signal it saw before, and the output projection divides channel c's prediction by it. Exact for the
    clean part of an input; the noise, drawn at unit variance in the new units, is not the noise the model was
    trained on, so this is a warm start for training in the new units, not the same model."""
    emb, out = model.patch_embedding, model.proj_out
    if ratio.shape != (emb.in_channels,) or emb.in_channels != out.out_features or not bool((ratio > 0).all()):
        raise ConfigError(f"Rescaling needs {emb.in_channels} positive channel ratios for a patch-1x1x1 DiT; got "
                          f"{tuple(ratio.shape)} for {emb.in_channels} input and {out.out_features} output channels.")
    r = ratio.to(emb.weight)
    with torch.no_grad():
        emb.weight.mul_(r.view(1, -1, 1, 1, 1))
        out.weight.div_(r.view(-1, 1))
        out.bias.div_(r)
    return model


def encode_clips(vae: PatchVAE, clips: torch.Tensor) -> torch.Tensor:
    """``[B, 33, H, W, 3]`` → normalized latents ``[B, 16, 9, h, w]``."""
    return torch.cat([vae.encode_video(c) for c in clips])


class CaptionBank:
    """Text-encoder outputs of every caption, computed once (the encoder is frozen)."""

    def __init__(self, encode: Callable[[str], torch.Tensor], captions: list[str]) -> None:
        self.index = {c: i for i, c in enumerate(captions)}
        with torch.no_grad():
            self.embeds = torch.cat([encode(c).float().cpu() for c in captions])

    def __call__(self, captions: list[str]) -> torch.Tensor:
        return self.embeds[[self.index[c] for c in captions]]


def object_weight_map(scenes: list[Scene], k: float, cell: int = 8, edge: float = 0.0) -> torch.Tensor:
    """``[B, 1, 9, h, w]`` loss weights 1 + k·c + edge·4c(1 − c) on the latent grid: a cell's cover c is the object's
    mean pixel cover over its ``cell``×``cell`` patch, the largest over the latent frame's pixel frames (frame 0 alone,
    then frames 4i−3..4i), so the object — a tenth of the pixels — is not drowned in the background's loss; the edge
    term is largest (``edge``) where the outline halves a cell and 0 in cells wholly inside or outside the object —
    the cells where a circle, a square and a triangle of one size differ."""
    cover = torch.stack([object_cover(s) for s in scenes])  # [B, 33, H, W]
    cells = torch.nn.functional.avg_pool2d(cover, cell)  # [B, 33, h, w]
    groups = [cells[:, :1]] + [cells[:, i:i + 4] for i in range(1, cells.shape[1], 4)]
    latent = torch.stack([g.amax(dim=1) for g in groups], dim=1)  # [B, 9, h, w]
    return (1 + k * latent + edge * 4 * latent * (1 - latent)).unsqueeze(1)


def flow_loss(model: CausalWanTransformer, x0: torch.Tensor, embeds: torch.Tensor, context: int,
              gen: torch.Generator, weight: torch.Tensor | None = None, *, pairs: bool = False,
              contrast: float = 0.0) -> torch.Tensor:
    """The flow-matching loss on block ``context`` of ``x0 [B,16,F,h,w]`` after ``context`` clean blocks; with
    ``weight [B,1,F,h,w]`` (:func:`object_weight_map`) a weighted mean, normalised by the block's mean weight.

    ``pairs``: samples (0, 1), (2, 3), … are one scene in two shapes (:func:`~sdvg.toy.world.render_shape_pairs`)
    and share their noise and σ, so what tells a pair's predictions apart at high noise is the shape word alone.
    ``contrast`` λ subtracts λ × the (weighted) error against the partner's target, as in contrastive flow matching
    with the pair's other shape as the negative: the minimum moves from the target u to u + λ/(1 − λ)·(u − u_partner),
    away from the other shape."""
    b = x0.shape[0]
    lo, hi = 3 * context, 3 * context + 3
    x0 = x0[:, :, :hi]
    draws = b // 2 if pairs else b
    sigma = torch.rand(draws, generator=gen)
    eps = torch.randn((draws, x0.shape[1], hi - lo, *x0.shape[3:]), generator=gen)
    if pairs:
        sigma, eps = sigma.repeat_interleave(2), eps.repeat_interleave(2, dim=0)
    s = sigma.view(b, 1, 1, 1, 1)
    noisy = (1 - s) * x0[:, :, lo:hi] + s * eps
    x = torch.cat([x0[:, :, :lo], noisy], dim=2)
    t = torch.zeros(b, hi)
    t[:, lo:] = (sigma * 1000).view(b, 1)
    v = model.forward_train(x, t, model.cross_attention(embeds))[:, :, lo:hi].float()
    target = eps - x0[:, :, lo:hi]
    w = torch.ones(()) if weight is None else weight[:, :, lo:hi]
    loss = ((v - target).square() * w).mean() / w.mean()
    if contrast:
        partner = torch.arange(b).view(-1, 2).flip(1).reshape(-1)
        loss = loss - contrast * ((v - target[partner]).square() * w).mean() / w.mean()
    return loss


def _lr(step: int, s: DiTTrainSettings) -> float:
    warm = min(1.0, (step + 1) / max(1, s.warmup))
    progress = min(1.0, step / max(1, s.steps))
    return s.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def ema_decay(step: int, target: float) -> float:
    """The EMA's decay at ``step``: warmed up as (1 + step) / (10 + step) up to ``target``, so an export taken early
    is not mostly the random initial weights (a fixed 0.998 still weighs them 37 % after 500 steps)."""
    return min(target, (1 + step) / (10 + step))


def _context_blocks(gen: torch.Generator) -> int:
    u = float(torch.rand((), generator=gen))
    acc = 0.0
    for i, p in enumerate(CONTEXT_BLOCKS):
        acc += p
        if u < acc:
            return i
    return len(CONTEXT_BLOCKS) - 1


def train_dit(role: str, spec: DiTSpec, settings: DiTTrainSettings, vae: PatchVAE, bank: CaptionBank,
              work: Path, *, progress: Callable[[dict], None] | None = None,
              on_save: Callable[[CausalWanTransformer, int], None] | None = None,
              warm_start: tuple[Path, int] | None = None) -> CausalWanTransformer:
    """Train (or resume) one toy DiT; returns its EMA model. State lives in ``work/state_<role>.pt``; ``on_save``
    gets the EMA model and the step after every state save (checkpoint exports). ``warm_start`` (an exported
    DiT file and its step), used only when there is no state: weights and EMA start from the file and training
    continues at that step (same data and learning-rate schedule) with fresh optimiser moments — the resume from
    a committed checkpoint, not bit-exact (the exact one needs the state)."""
    state_path = work / f"state_{role}.pt"
    model = build_dit(spec, settings.seed)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                            betas=(0.9, 0.99))
    step, losses = _restore(role, state_path, model, ema, opt, warm_start)
    t0, first = time.perf_counter(), step
    pool = train_captions()  # the held-out third of the captions is never drawn
    while step < settings.steps:
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
        clips, scenes = (render_shape_pairs(gen, settings.batch // 2, CLIP_FRAMES, pool=pool) if settings.shape_pairs
                         else render_batch(gen, settings.batch, CLIP_FRAMES, pool=pool))
        x0 = encode_clips(vae, clips)
        for g in opt.param_groups:
            g["lr"] = _lr(step, settings)
        weight = (object_weight_map(scenes, settings.object_weight, edge=settings.edge_weight)
                  if settings.object_weight or settings.edge_weight else None)
        loss = flow_loss(model, x0, bank([s.caption for s in scenes]), _context_blocks(gen), gen, weight,
                         pairs=settings.shape_pairs, contrast=settings.shape_contrast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = ema_decay(step, settings.ema)
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - decay)
        step += 1
        losses.append(loss.item())
        if progress is not None:
            progress({"role": role, "step": step, "steps": settings.steps, "loss": losses[-1],
                      "s_per_step": (time.perf_counter() - t0) / max(1, step - first)})
        if step % settings.save_every == 0 or step == settings.steps:
            _save_state(state_path, model, ema, opt, step, losses, spec, settings)
            if on_save is not None:
                on_save(ema, step)
    return ema


def _restore(role: str, state_path: Path, model, ema, opt, warm_start: tuple[Path, int] | None) -> tuple[int, list]:
    """Load the training state (exact resume) or, without one, the warm start's weights; → (step, losses)."""
    if state_path.is_file():
        st = torch_load(state_path)
        model.load_state_dict(st["model"])
        ema.load_state_dict(st["ema"])
        opt.load_state_dict(st["opt"])
        logger.info("resuming the toy %s at step %d", role, int(st["step"]))
        return int(st["step"]), list(st["losses"])
    if warm_start is None:
        return 0, []
    from ..loaders.wan import load_dit

    path, step = warm_start
    weights = load_dit(path, dtype="fp32", device="cpu").state_dict()
    model.load_state_dict(weights)
    ema.load_state_dict(weights)
    logger.info("warm start of the toy %s from %s at step %d (fresh optimiser moments)", role, path, step)
    return int(step), []


def _save_state(path: Path, model, ema, opt, step: int, losses: list[float], spec: DiTSpec,
                settings: DiTTrainSettings) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step,
                "losses": losses, "spec": asdict(spec), "settings": asdict(settings)}, tmp)
    tmp.replace(path)


def original_state_dict(model: CausalWanTransformer) -> dict[str, torch.Tensor]:
    """The model's weights under the original Wan 2.1 key names (fp32, detached)."""
    return to_original_keys(model.state_dict())
