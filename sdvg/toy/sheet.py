"""A contact sheet of the toy models' videos: for each caption, target-only, draft-only and SDVG rows of every 4th
frame, each labelled with the method, the judge's caption accuracy and (SDVG) the accepted drafts."""

from __future__ import annotations

from pathlib import Path

import torch

from .preset import TOY_DIR, TOY_TAU, toy_prompts

FRAME_STEP = 4
LABEL_W = 250


def toy_sampler_config(num_blocks: int | None = None, seed: int = 0, models_dir: str | Path = TOY_DIR,
                       step_noise: str | None = None):
    """The toy models' sampling: their 10-step schedule with the toy step noise (``step_noise`` overrides it), the
    drafter on its own schedule where the tree's stamp says it has one
    (:func:`~sdvg.toy.preset.toy_drafter_sampling`)."""
    from ..sampling.config import SamplerConfig
    from .preset import TOY_BLOCKS, TOY_SCHEDULE, TOY_SIZE, TOY_STEP_NOISE, toy_drafter_sampling

    drafter = toy_drafter_sampling(models_dir)
    return SamplerConfig(num_blocks=num_blocks or TOY_BLOCKS, width=TOY_SIZE[0], height=TOY_SIZE[1], seed=seed,
                         schedule=TOY_SCHEDULE, step_noise=step_noise or TOY_STEP_NOISE,
                         drafter_schedule=drafter.get("schedule"), drafter_step_noise=drafter.get("step_noise")).validate()


def load_toy_models(models_dir: str | Path = TOY_DIR):
    from ..loaders.bundle import load_models

    return load_models(models_dir, dit_device="cpu", aux_device="cpu", dtype="fp32")


def run_toy(models, caption: str, mode: str, *, tau: float = TOY_TAU, seed: int = 0,
            num_blocks: int | None = None, models_dir: str | Path = TOY_DIR):
    """One toy video (``mode``: target-only, draft-only or reward) of the models of ``models_dir`` → the sampler's
    result."""
    from ..sampling.router import RouterConfig
    from ..sampling.sampler import SpeculativeSampler

    router = RouterConfig(mode=mode, tau=tau, aggregation="min") if mode == "reward" else RouterConfig(mode=mode)
    return SpeculativeSampler(models, router, toy_sampler_config(num_blocks, seed, models_dir)).run(caption)


def contact_sheet(out: str | Path, *, models_dir: str | Path = TOY_DIR, n_captions: int = 4, tau: float = TOY_TAU,
                  seed: int = 0) -> Path:
    from PIL import Image, ImageDraw

    from .judge import judge

    models = load_toy_models(models_dir)
    rows: list[tuple[str, torch.Tensor]] = []
    for caption in toy_prompts(n_captions, seed=2026 + seed):
        for mode, name in (("target-only", "target"), ("draft-only", "drafter"), ("reward", f"SDVG tau={tau:g}")):
            res = run_toy(models, caption, mode, tau=tau, seed=seed, models_dir=models_dir)
            frames = res.frames if res.frames.is_floating_point() else res.frames.float() / 255
            v = judge(frames, caption)
            extra = ""
            if mode == "reward":
                drafted = [b for b in res.blocks if b.drafted]
                extra = f", {sum(b.decision == 'accept' for b in drafted)}/{len(drafted)} drafts kept"
            rows.append((f"{caption}\n{name}: judge {v.accuracy:.2f}{extra}", frames[::FRAME_STEP]))
    h, w = rows[0][1].shape[1:3]
    cols = max(r[1].shape[0] for r in rows)
    sheet = Image.new("RGB", (LABEL_W + cols * (w + 2), len(rows) * (h + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (label, frames) in enumerate(rows):
        y = i * (h + 4)
        draw.multiline_text((4, y + 8), label.replace(" moving", "\nmoving", 1), fill=(20, 20, 20))
        for j, f in enumerate(frames):
            img = Image.fromarray((f.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
            sheet.paste(img, (LABEL_W + j * (w + 2), y))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out
