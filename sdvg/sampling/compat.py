"""Compatibility switches: our defaults, or the SDVG authors' exact behaviour (``--profile reference``).

Our engine matches Self-Forcing and Krea in the DiT, the caches and the scheduler; six choices in the glue around
them differ from the authors' code (``yuezhouhu/spec-video-gen``, a fork of Krea's server). Each is a legitimate
choice; :class:`Compat` picks either side of each one, and the named profiles pick all six at once
(``docs/REFERENCE.md`` says which side is faithful to what, and what each costs on the tiny models):

===================  ===========================  ===============================================================
switch               ``sdvg`` (default)           ``reference``
===================  ===========================  ===============================================================
t0_tail_step         False: 4 steps               True: Krea's [1000, 937.5, 833.33, 625, 0]; the t = 0 call
                                                  re-noises to the smallest table σ and converts with that σ
vae_decoder          "wan": exact streaming       "krea": Krea's decoder caches the current frame twice in the
                     decode of the Wan VAE        first temporal upsampler (differs from pixel frame 9 on)
block0_frames        9                            6: the first 3 pixel frames of block 0 are not shown
pt_weights           "ema": generator_ema         "generator": a training dict's ``generator`` first
threshold_state      "per-video"                  "pooled": target-rate statistics shared by every video of one
                                                  sampler (the reference's module global)
reward_preprocess    "torch": float frames,       "pil": uint8 frames (x·255 truncated) resized by PIL bicubic
                     antialiased torch bicubic
===================  ===========================  ===============================================================
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import ConfigError

VAE_DECODERS = ("wan", "krea")
BLOCK0_FRAMES = (9, 6)
PT_WEIGHTS = ("ema", "generator")
THRESHOLD_STATES = ("per-video", "pooled")
REWARD_PREPROCESS = ("torch", "pil")
_CHOICES: dict[str, tuple] = {
    "t0_tail_step": (False, True), "vae_decoder": VAE_DECODERS, "block0_frames": BLOCK0_FRAMES,
    "pt_weights": PT_WEIGHTS, "threshold_state": THRESHOLD_STATES, "reward_preprocess": REWARD_PREPROCESS,
}


@dataclass(frozen=True)
class Compat:
    t0_tail_step: bool = False
    vae_decoder: str = "wan"
    block0_frames: int = 9
    pt_weights: str = "ema"
    threshold_state: str = "per-video"
    reward_preprocess: str = "torch"

    def __post_init__(self) -> None:
        for name, valid in _CHOICES.items():
            value = getattr(self, name)
            if value not in valid or isinstance(value, bool) != isinstance(valid[0], bool):
                raise ConfigError(f"Compatibility switch {name}={value!r} is not one of "
                                  f"{', '.join(map(repr, valid))}.")

    @property
    def dropped_frames(self) -> int:
        """Pixel frames of block 0 that are not shown (the reference drops the first 3)."""
        return 9 - self.block0_frames

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self) -> list[str]:
        """The switches that differ from our defaults."""
        base = Compat()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)]


PROFILES: dict[str, Compat] = {
    "sdvg": Compat(),
    "reference": Compat(t0_tail_step=True, vae_decoder="krea", block0_frames=6, pt_weights="generator",
                        threshold_state="pooled", reward_preprocess="pil"),
}


DEFAULT_PROFILE = "sdvg"  # the profile whose switches are Compat()'s defaults


def profile(name: str, **overrides: Any) -> Compat:
    """The named profile with single switches replaced (``None`` overrides are ignored)."""
    if name not in PROFILES:
        raise ConfigError(f"Unknown compatibility profile {name!r}. Valid: {', '.join(PROFILES)}.")
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(_CHOICES))
    if unknown:
        raise ConfigError(f"Unknown compatibility switch(es) {unknown}. Valid: {', '.join(_CHOICES)}.")
    return replace(PROFILES[name], **given)


def add_compat_args(p: argparse.ArgumentParser, *, profile_flag: str = "--profile") -> None:
    """``--profile`` (sdvg | reference) and one flag per switch (each overrides the profile)."""
    g = p.add_argument_group("compatibility with the authors' code (docs/REFERENCE.md)")
    g.add_argument(profile_flag, dest="compat_profile", choices=list(PROFILES), default=DEFAULT_PROFILE,
                   help="sdvg (ours) or reference (all six of the authors' behaviours)")
    on_off = {"on": True, "off": False}
    g.add_argument("--t0-tail-step", choices=list(on_off), default=None,
                   help="Krea's 5th step at t = 0 (re-noise to the smallest σ)")
    g.add_argument("--vae-decoder", choices=VAE_DECODERS, default=None, help="wan (exact) or krea (Krea's cache)")
    g.add_argument("--block0-frames", type=int, choices=BLOCK0_FRAMES, default=None, help="frames shown of block 0")
    g.add_argument("--pt-weights", choices=PT_WEIGHTS, default=None, help="which weights of a training .pt")
    g.add_argument("--threshold-state", choices=THRESHOLD_STATES, default=None,
                   help="target-rate statistics per video or pooled over the run's prompts")
    g.add_argument("--reward-preprocess", choices=REWARD_PREPROCESS, default=None,
                   help="ImageReward input: torch (float, antialiased) or pil (uint8, PIL bicubic)")


def compat_from_args(args) -> Compat:
    tail = getattr(args, "t0_tail_step", None)
    return profile(
        getattr(args, "compat_profile", None) or DEFAULT_PROFILE,
        t0_tail_step=None if tail is None else tail == "on",
        vae_decoder=getattr(args, "vae_decoder", None), block0_frames=getattr(args, "block0_frames", None),
        pt_weights=getattr(args, "pt_weights", None), threshold_state=getattr(args, "threshold_state", None),
        reward_preprocess=getattr(args, "reward_preprocess", None),
    )
