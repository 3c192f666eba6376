"""The toy world: one flat-coloured shape moving across a plain background, rendered by our own code.

Everything is procedural and seeded (no data files): a :class:`Scene` is drawn from a ``torch.Generator``, its
caption comes from a template ("a red circle moving left on a black background") and :func:`render` draws its
frames with anti-aliased edges from a signed distance. The world is deliberately small (three shapes, six object
colours, three backgrounds, four directions, large objects; 216 captions, a third of them held out of
training) so that models of a few million parameters learn it on
a CPU; :func:`parse_caption` reads a caption back, so the judge can compare a video with what was asked.

Frames are ``[N, H, W, 3]`` float32 in [0, 1] like the pipeline's output. A clip of ``n`` pixel frames moves the
object at a constant speed; it bounces off the frame's edges when a video runs longer than the object has room.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError

SHAPES = ("circle", "square", "triangle")
OBJECT_COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.3, 0.95),
                  "yellow": (0.95, 0.85, 0.1), "magenta": (0.85, 0.15, 0.8), "cyan": (0.1, 0.8, 0.85)}
BACKGROUNDS = {"black": (0.05, 0.05, 0.05), "white": (0.95, 0.95, 0.95), "grey": (0.5, 0.5, 0.5)}
#: the first world's palette (72 captions): the toy tokenizer was trained on these captions and is kept as it was
V1_COLOURS, V1_BACKGROUNDS = ("red", "green", "blue"), ("black", "white")
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
ATTRIBUTES = ("background", "colour", "shape", "direction")
SIZE = 64  # the toy world's frames are 64×64 pixels (8×8 latents)
RADIUS = (12.0, 15.0)  # object half-size in pixels at SIZE
SPEED = (0.55, 0.8)  # pixels per frame at SIZE
CLIP_FRAMES = 33  # 9 latent frames = 3 blocks: the training length
_CAPTION = re.compile(r"^an? (\w+) (\w+) moving (\w+) on an? (\w+) background$")


@dataclass(frozen=True)
class Scene:
    """One clip's ground truth: what the caption says plus where the object starts and how fast it moves."""

    shape: str
    colour: str
    background: str
    direction: str
    x: float  # start centre, in units of the frame size (0..1)
    y: float
    radius: float  # in units of the frame size
    speed: float  # frame sizes per pixel frame

    @property
    def caption(self) -> str:
        return caption_of(self.colour, self.shape, self.direction, self.background)

    def attributes(self) -> dict[str, str]:
        return {"background": self.background, "colour": self.colour, "shape": self.shape,
                "direction": self.direction}


def caption_of(colour: str, shape: str, direction: str, background: str) -> str:
    return f"a {colour} {shape} moving {direction} on a {background} background"


def parse_caption(text: str) -> dict[str, str]:
    """The four attributes of a toy caption; a ConfigError names what is not in the world."""
    m = _CAPTION.match(text.strip().lower())
    if not m:
        raise ConfigError(f"{text!r} is not a toy-world caption; write e.g. '{caption_of('red', 'circle', 'left', 'black')}'.")
    colour, shape, direction, background = m.groups()
    for value, known, what in ((colour, OBJECT_COLOURS, "colour"), (shape, SHAPES, "shape"),
                               (direction, DIRECTIONS, "direction"), (background, BACKGROUNDS, "background")):
        if value not in known:
            raise ConfigError(f"The toy world has no {what} {value!r}; it knows {', '.join(known)}.")
    return {"background": background, "colour": colour, "shape": shape, "direction": direction}


def all_captions() -> list[str]:
    """Every caption the world can write (216), in a fixed order."""
    return [caption_of(c, s, d, b) for b in BACKGROUNDS for c in OBJECT_COLOURS for s in SHAPES for d in DIRECTIONS]


def v1_captions() -> list[str]:
    """The first world's 72 captions (three colours, two backgrounds): the text the toy tokenizer was trained on."""
    return [caption_of(c, s, d, b) for b in V1_BACKGROUNDS for c in V1_COLOURS for s in SHAPES for d in DIRECTIONS]


def is_held_out(caption: str) -> bool:
    """Whether a caption is in the held-out third (72 of 216) that training never sees: the sum of its attribute
    indices is a multiple of 3. Every pair of attribute values still occurs in training, so a held-out caption is
    a new combination of words the models know."""
    a = parse_caption(caption)
    idx = (list(BACKGROUNDS).index(a["background"]) + list(OBJECT_COLOURS).index(a["colour"])
           + SHAPES.index(a["shape"]) + list(DIRECTIONS).index(a["direction"]))
    return idx % 3 == 0


def train_captions() -> list[str]:
    """The 144 captions training draws from."""
    return [c for c in all_captions() if not is_held_out(c)]


def held_out_captions(n: int | None = None) -> list[str]:
    """The 72 captions no toy model is trained on (the evaluation's prompts); ``n``: that many of them, spread evenly
    over all 72 (quick checks)."""
    held = [c for c in all_captions() if is_held_out(c)]
    if n is None:
        return held
    if n < 1:
        raise ConfigError(f"Ask for at least one held-out caption, got {n}.")
    return held[:: max(1, len(held) // n)][:n]


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=gen))


def _pick(gen: torch.Generator, options) -> str:
    options = list(options)
    return options[int(torch.randint(len(options), (), generator=gen))]


def sample_scene(gen: torch.Generator, *, frames: int = CLIP_FRAMES, caption: str | None = None) -> Scene:
    """A random scene (or one matching ``caption``) whose object stays in the frame for ``frames`` frames when it
    can (longer clips bounce)."""
    attrs = parse_caption(caption) if caption is not None else {
        "background": _pick(gen, BACKGROUNDS), "colour": _pick(gen, OBJECT_COLOURS), "shape": _pick(gen, SHAPES),
        "direction": _pick(gen, DIRECTIONS)}
    radius = _uniform(gen, *RADIUS) / SIZE
    speed = _uniform(gen, *SPEED) / SIZE
    dx, dy = DIRECTIONS[attrs["direction"]]
    travel = min(speed * (frames - 1), 1.0 - 2 * radius - 0.02)
    lo, hi = radius + 0.01, 1.0 - radius - 0.01
    # along the motion: start so the whole path fits; across it: anywhere
    along = _uniform(gen, lo, hi - travel)
    across = _uniform(gen, lo, hi)
    if dx:
        x, y = (along if dx > 0 else 1.0 - along), across
    else:
        x, y = across, (along if dy > 0 else 1.0 - along)
    return Scene(attrs["shape"], attrs["colour"], attrs["background"], attrs["direction"], x, y, radius, speed)


def _bounce(p: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Reflect positions into [lo, hi] (a triangle wave)."""
    span = hi - lo
    if span <= 0:
        return torch.full_like(p, (lo + hi) / 2)
    q = torch.remainder(p - lo, 2 * span)
    return lo + torch.where(q > span, 2 * span - q, q)


def centres(scene: Scene, frames: int, start: int = 0) -> torch.Tensor:
    """``[frames, 2]`` object centres (x, y in frame units) for frames ``start..start+frames``."""
    t = torch.arange(start, start + frames, dtype=torch.float64)
    dx, dy = DIRECTIONS[scene.direction]
    lo, hi = scene.radius, 1.0 - scene.radius
    x = _bounce(scene.x + dx * scene.speed * t, lo, hi)
    y = _bounce(scene.y + dy * scene.speed * t, lo, hi)
    return torch.stack([x, y], dim=1)


def _distance(shape: str, u: torch.Tensor, v: torch.Tensor, r: float) -> torch.Tensor:
    """Signed distance (frame units) of points (u, v) relative to the centre from a shape of half-size r."""
    if shape == "circle":
        return torch.sqrt(u * u + v * v) - r
    if shape == "square":
        s = r * 0.86  # about the circle's area
        return torch.maximum(u.abs(), v.abs()) - s
    # an upright equilateral triangle with circumradius ~1.2 r, centred on its centroid
    k = math.sqrt(3.0)
    rr = r * 1.25
    a = (k * u.abs() + v) / 2.0 - rr / 2.0
    return torch.maximum(a, -v - rr / 2.0)


def object_cover(scene: Scene, frames: int = CLIP_FRAMES, *, size: int = SIZE, start: int = 0) -> torch.Tensor:
    """``[frames, size, size]`` in [0, 1]: how much of each pixel the object covers (one-pixel anti-aliased edge)."""
    c = centres(scene, frames, start).to(torch.float32)
    grid = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    u = grid.view(1, 1, size) - c[:, 0].view(-1, 1, 1)
    v = grid.view(1, size, 1) - c[:, 1].view(-1, 1, 1)
    return (0.5 - _distance(scene.shape, u, v, scene.radius) * size).clamp(0.0, 1.0)


def render(scene: Scene, frames: int = CLIP_FRAMES, *, size: int = SIZE, start: int = 0) -> torch.Tensor:
    """``[frames, size, size, 3]`` float32 in [0, 1]: frames ``start..start+frames`` of the scene."""
    if frames < 1 or size < 8:
        raise ConfigError(f"render needs at least one frame and 8 pixels, got {frames} frames at {size}.")
    cover = object_cover(scene, frames, size=size, start=start).unsqueeze(-1)
    bg = torch.tensor(BACKGROUNDS[scene.background]).view(1, 1, 1, 3)
    fg = torch.tensor(OBJECT_COLOURS[scene.colour]).view(1, 1, 1, 3)
    return (bg * (1 - cover) + fg * cover).contiguous()


def render_batch(gen: torch.Generator, batch: int, frames: int = CLIP_FRAMES, *, size: int = SIZE,
                 captions: list[str] | None = None, pool: list[str] | None = None) -> tuple[torch.Tensor, list[Scene]]:
    """``[B, frames, size, size, 3]`` clips of random scenes (or of ``captions``; or of captions drawn from
    ``pool``) and their scenes."""
    if captions is None and pool is not None:
        captions = [pool[int(torch.randint(len(pool), (), generator=gen))] for _ in range(batch)]
    scenes = [sample_scene(gen, frames=frames, caption=None if captions is None else captions[i])
              for i in range(batch)]
    return torch.stack([render(s, frames, size=size) for s in scenes]), scenes


def shape_partner(caption: str) -> str:
    """The one other training caption that differs from a training ``caption`` only in its shape (of the three
    shapes with one colour, direction and background, exactly one is held out)."""
    if is_held_out(caption):
        raise ConfigError(f"{caption!r} is a held-out caption; shape partners are training captions.")
    a = parse_caption(caption)
    return next(c for c in (caption_of(a["colour"], s, a["direction"], a["background"]) for s in SHAPES)
                if c != caption and not is_held_out(c))


def render_shape_pairs(gen: torch.Generator, pairs: int, frames: int = CLIP_FRAMES, *, size: int = SIZE,
                       pool: list[str] | None = None) -> tuple[torch.Tensor, list[Scene]]:
    """``[2·pairs, frames, size, size, 3]`` clips in pairs (0, 1), (2, 3), …: one scene drawn from ``pool`` (default
    the training captions) and the same scene — place, size, speed, colour, background, motion — in its
    :func:`shape_partner`'s shape. Within a pair only the shape and its word differ."""
    pool = pool if pool is not None else train_captions()
    scenes: list[Scene] = []
    for _ in range(pairs):
        scene = sample_scene(gen, frames=frames, caption=pool[int(torch.randint(len(pool), (), generator=gen))])
        scenes += [scene, replace(scene, shape=parse_caption(shape_partner(scene.caption))["shape"])]
    return torch.stack([render(s, frames, size=size) for s in scenes]), scenes
