"""The toy world's judge: how well a video shows its caption, measured against the world's ground truth.

It is independent of the router's critic (a trained ImageReward-format model): the judge reads pixels with fixed
rules and one small classifier fitted on renders. Per frame it finds the background (the median of the border,
snapped to the palette), the object (pixels far from the background), the object's colour (median, snapped), its
shape (nearest centroid on mask features — fill of the bounding box, aspect, and where the mass sits vertically —
fitted on renders) and its centre. Per video:

* **valid** (is it a picture of this world at all): ≥ 85 % of the pixels near the background or the object colour
  and an object of plausible area in ≥ 80 % of the frames;
* **attributes**: background, colour and shape by majority over frames; direction from the centre's displacement
  (at least 5 % of the frame along the dominant axis);
* **accuracy** ("caption accuracy"): the fraction of the four attributes that match the caption, 0 when invalid;
* **smooth** (temporal consistency, reported beside it): the fraction of frame-to-frame steps where the object's
  centre moves at most 6 % of the frame (real motion is ≤ 1.3 %) and its area changes by at most 30 %.

:func:`validate_judge` checks it the way the issue asks: renders score ≥ 0.9, noise ≤ 0.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from .world import ATTRIBUTES, BACKGROUNDS, DIRECTIONS, OBJECT_COLOURS, SHAPES, parse_caption, render, sample_scene

_BG = torch.tensor(list(BACKGROUNDS.values()))
_FG = torch.tensor(list(OBJECT_COLOURS.values()))
BG_NAMES, FG_NAMES = list(BACKGROUNDS), list(OBJECT_COLOURS)
NEAR = 0.3  # RGB distance that counts as "this palette colour"
AREA = (0.03, 0.35)  # plausible object area, fraction of the frame


@dataclass
class Verdict:
    """The judge's reading of one video against its caption."""

    valid: bool
    attributes: dict[str, str | None]
    correct: dict[str, bool]
    accuracy: float
    checks: dict[str, float] = field(default_factory=dict)
    smooth: float = 0.0

    @property
    def all_correct(self) -> bool:
        return self.accuracy == 1.0

    @property
    def ungated(self) -> float:
        """The fraction of the four attributes read as the caption says, without the validity gate: it shows progress
        (a blue smear in the right place) that ``accuracy`` hides. Chance is above 0.125 (the background is one of two)."""
        return sum(self.correct.values()) / len(ATTRIBUTES)


def agreement(frames: torch.Tensor, reference: torch.Tensor, caption: str) -> float:
    """Fidelity to a reference video (the teacher's from the same noise): the fraction of the four attributes the
    judge reads the same, non-missing value for in both. A flat field reads no colour, shape or direction, so it agrees
    on the background at most; the reference agrees with itself on every attribute it can read."""
    a, b = judge(frames, caption).attributes, judge(reference, caption).attributes
    return sum(a[k] is not None and a[k] == b[k] for k in ATTRIBUTES) / len(ATTRIBUTES)


def _features(mask: torch.Tensor) -> torch.Tensor | None:
    """Shape features of a binary mask ``[H, W]``: bbox fill, aspect, vertical mass balance."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if ys.numel() < 8:
        return None
    h = float(ys.max() - ys.min() + 1)
    w = float(xs.max() - xs.min() + 1)
    fill = ys.numel() / (h * w)
    mid = (ys.max() + ys.min()).float() / 2
    top = float((ys.float() < mid).sum()) / ys.numel()  # triangles put their mass low
    return torch.tensor([fill, h / w, top])


@lru_cache(maxsize=1)
def _shape_centroids() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-shape mean and spread of the mask features over 60 renders each (seeded): the fitted classifier."""
    gen = torch.Generator().manual_seed(1234)
    means, stds = [], []
    for shape in SHAPES:
        feats = []
        for _ in range(60):
            scene = replace(sample_scene(gen), shape=shape)
            frame = render(scene, 1)[0]
            f = _features(_object_mask(frame, _BG[BG_NAMES.index(scene.background)]))
            if f is not None:
                feats.append(f)
        stack = torch.stack(feats)
        means.append(stack.mean(0))
        stds.append(stack.std(0) + 0.02)
    return torch.stack(means), torch.stack(stds)


def _object_mask(frame: torch.Tensor, bg: torch.Tensor) -> torch.Tensor:
    return (frame - bg).norm(dim=-1) > 0.45


def classify_shape(mask: torch.Tensor) -> str | None:
    f = _features(mask)
    if f is None:
        return None
    means, stds = _shape_centroids()
    d = (((f - means) / stds) ** 2).sum(1)
    return SHAPES[int(d.argmin())]


def _frame(frame: torch.Tensor) -> dict:
    """Read one frame ``[H, W, 3]`` in [0, 1]."""
    border = torch.cat([frame[0], frame[-1], frame[:, 0], frame[:, -1]])
    bg_rgb = border.median(dim=0).values
    d_bg = (_BG - bg_rgb).norm(dim=1)
    bg_i = int(d_bg.argmin())
    bg = _BG[bg_i]
    mask = _object_mask(frame, bg)
    area = float(mask.float().mean())
    out = {"background": BG_NAMES[bg_i] if float(d_bg[bg_i]) < NEAR else None, "area": area, "colour": None,
           "shape": None, "centre": None}
    near_bg = (frame - bg).norm(dim=-1) < NEAR
    if mask.sum() >= 8:
        fg_rgb = frame[mask].median(dim=0).values
        d_fg = (_FG - fg_rgb).norm(dim=1)
        fg_i = int(d_fg.argmin())
        if float(d_fg[fg_i]) < NEAR:
            out["colour"] = FG_NAMES[fg_i]
            near_fg = (frame - _FG[fg_i]).norm(dim=-1) < NEAR
            near_bg = near_bg | near_fg
        out["shape"] = classify_shape(mask)
        ys, xs = torch.nonzero(mask, as_tuple=True)
        out["centre"] = (float(xs.float().mean()) / frame.shape[1], float(ys.float().mean()) / frame.shape[0])
    out["palette"] = float(near_bg.float().mean())
    return out


def _majority(values: list[str | None]) -> str | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return max(dict.fromkeys(known), key=known.count)


def _direction(centres: list[tuple[float, float]]) -> str | None:
    if len(centres) < 2:
        return None
    dx, dy = centres[-1][0] - centres[0][0], centres[-1][1] - centres[0][1]
    if max(abs(dx), abs(dy)) < 0.05:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def judge(frames: torch.Tensor, caption: str) -> Verdict:
    """Judge ``frames [N, H, W, 3]`` (float in [0, 1] or uint8) against a toy caption."""
    want = parse_caption(caption)
    frames = frames.detach().cpu()
    if frames.dtype == torch.uint8:
        frames = frames.float() / 255.0
    reads = [_frame(f.float()) for f in frames]
    objects = [r for r in reads if AREA[0] <= r["area"] <= AREA[1] and r["centre"] is not None]
    areas = torch.tensor([r["area"] for r in objects]) if objects else torch.zeros(1)
    centres = [r["centre"] for r in objects]
    jumps = [max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(centres, centres[1:], strict=False)]
    grow = [abs(a["area"] - b["area"]) / max(a["area"], 1e-6) for a, b in zip(objects, objects[1:], strict=False)]
    checks = {
        "palette": sum(r["palette"] for r in reads) / len(reads),
        "object_frames": len(objects) / len(reads),
        "area_cv": float(areas.std() / areas.mean()) if len(objects) > 1 and float(areas.mean()) > 0 else 1.0,
        "max_jump": max(jumps) if jumps else 1.0,
    }
    valid = checks["palette"] >= 0.85 and checks["object_frames"] >= 0.8
    steady = [j <= 0.06 and g <= 0.3 for j, g in zip(jumps, grow, strict=True)]
    smooth = sum(steady) / (len(reads) - 1) if valid and len(reads) > 1 else 0.0
    got = {
        "background": _majority([r["background"] for r in reads]),
        "colour": _majority([r["colour"] for r in objects]),
        "shape": _majority([r["shape"] for r in objects]),
        "direction": _direction(centres),
    }
    correct = {a: got[a] == want[a] for a in ATTRIBUTES}
    accuracy = sum(correct.values()) / len(ATTRIBUTES) if valid else 0.0
    return Verdict(valid, got, correct, accuracy, checks, smooth)


def judge_metric(frames: torch.Tensor, prompt: str) -> dict[str, float]:
    """The judge as an ``sdvg eval`` metric (``--metric sdvg.toy.judge:judge_metric``): caption accuracy, whether
    every attribute matched, validity and per-attribute correctness."""
    v = judge(frames, prompt)
    out = {"judge": v.accuracy, "judge_all": float(v.all_correct), "judge_valid": float(v.valid),
           "judge_smooth": v.smooth}
    out.update({f"judge_{a}": float(v.valid and v.correct[a]) for a in ATTRIBUTES})
    out["judge_chance"] = chance_corrected(out["judge_shape"], out["judge_direction"])
    return out


#: what guessing scores on the attributes a model can get right without reading the caption's words about them
CHANCE = {"shape": 1 / len(SHAPES), "direction": 1 / len(DIRECTIONS)}


def chance_corrected(shape: float, direction: float) -> float:
    """Shape and direction accuracy with guessing taken out, averaged: (acc − chance) / (1 − chance) for each (0 =
    guessing, 1 = always right, below 0 = worse than guessing). Linear, so its mean over videos is the mean's."""
    return ((shape - CHANCE["shape"]) / (1 - CHANCE["shape"])
            + (direction - CHANCE["direction"]) / (1 - CHANCE["direction"])) / 2


def validate_judge(n: int = 24, seed: int = 7, frames: int = 33) -> dict[str, float]:
    """Mean caption accuracy and smoothness of the judge on ``n`` renders of random scenes and on ``n`` uniform-noise
    clips."""
    gen = torch.Generator().manual_seed(seed)
    real, noise = [], []
    for _ in range(n):
        scene = sample_scene(gen, frames=frames)
        real.append(judge(render(scene, frames), scene.caption))
        noise.append(judge(torch.rand(frames, 64, 64, 3, generator=gen), scene.caption))
    return {"real": sum(v.accuracy for v in real) / n, "noise": sum(v.accuracy for v in noise) / n,
            "real_smooth": sum(v.smooth for v in real) / n, "noise_smooth": sum(v.smooth for v in noise) / n}


__all__ = ["CHANCE", "Verdict", "agreement", "chance_corrected", "judge", "judge_metric", "validate_judge"]
