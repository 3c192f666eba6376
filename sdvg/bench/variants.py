"""The bench's rows ("variants") and how each one is configured.

Acceptance is forced, so it does not depend on random weights: a row at level L accepts exactly round(L × drafted)
drafted blocks, at blocks drawn at random (seeded), through the router's ``pattern`` mode. ``random`` rows decide by
the pattern alone; ``scored`` rows run the real SDVG path (snapshot, decode, ImageReward on every frame of every
draft: ``score_drafts``) and still decide by the pattern, so the cost of scoring is paid as in a real run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..sampling.regimes import CacheConfig
from ..sampling.router import RouterConfig, random_pattern

LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
ROUTERS = ("target-only", "draft-only", "random", "scored")
HYBRID_CASCADE = 4  # SDVG-hybrid rows: 4 of 12 frames scored first (the authors' choice)
HYBRID_STITCH_STEP = 2  # ... and on reject the target finishes the drafter's state from step 2 of 4


@dataclass(frozen=True)
class Variant:
    """One benchmark row. ``router``: target-only | draft-only | random | scored."""

    name: str
    router: str
    level: float | None = None
    regime: str = "recompute"
    schedule: str = "constant"
    pipelined: bool = False
    refine_from_step: int | None = None
    group: str = "sweep"
    cascade: int = 0  # SDVG-hybrid: frames scored first (a rejected draft is scored on these only: the best case)
    stitch: bool = False  # SDVG-hybrid: step stitch at refine_from_step

    @property
    def baseline_key(self) -> str:
        return f"{self.regime}/{self.schedule}"


def default_variants(profile: str = "tiny", levels: Sequence[float] = LEVELS) -> list[Variant]:
    """The default rows. ``tiny``: everything; ``real-size``: the scored (real-cost) rows only; ``paper-ratio``: the
    scored and the hybrid rows."""
    pct = {lv: f"{round(lv * 100)}%" for lv in levels}
    rows = [
        Variant("target-only", "target-only", group="baseline"),
        Variant("draft-only", "draft-only", group="baseline"),
    ]
    if profile == "paper-ratio":
        return [*rows, *(Variant(f"scored @{pct[lv]}", "scored", lv, group="scored") for lv in levels),
                *(Variant(f"hybrid @{pct[lv]}", "scored", lv, refine_from_step=HYBRID_STITCH_STEP,
                          cascade=HYBRID_CASCADE, stitch=True, group="hybrid") for lv in levels)]
    if profile == "tiny":
        rows += [Variant(f"random @{pct[lv]}", "random", lv, group="random") for lv in levels]
    rows += [Variant(f"scored @{pct[lv]}", "scored", lv, group="scored") for lv in levels]
    piped = levels if profile == "tiny" else [lv for lv in levels if lv >= 0.75]
    rows += [Variant(f"pipelined @{pct[lv]}", "scored", lv, pipelined=True, group="pipelined") for lv in piped]
    mid = 0.5 if 0.5 in levels else levels[len(levels) // 2]
    hi = 0.75 if 0.75 in levels else levels[-1]
    rows += [Variant(f"hybrid @{pct[lv]}", "scored", lv, refine_from_step=HYBRID_STITCH_STEP, cascade=HYBRID_CASCADE,
                     stitch=True, group="hybrid") for lv in levels]
    rows += [
        Variant(f"refine@2 @{pct.get(mid, mid)}", "scored", mid, refine_from_step=2, group="refine"),
        Variant("target-only noisy", "target-only", regime="noisy", group="noisy"),
        Variant(f"scored noisy @{pct.get(hi, hi)}", "scored", hi, regime="noisy", group="noisy"),
        Variant("target-only diagonal", "target-only", regime="noisy", schedule="diagonal", group="diagonal"),
        Variant(f"scored diagonal @{pct.get(hi, hi)}", "scored", hi, regime="noisy", schedule="diagonal",
                group="diagonal"),
    ]
    if profile == "tiny":
        rows.append(Variant("target-only global", "target-only", regime="global", group="global"))
    return rows


def level_pattern(n_drafted: int, level: float, seed: int = 0) -> tuple[bool, ...]:
    """Exactly ``round(level × n_drafted)`` accepted drafted blocks, at seeded random places."""
    if not 0.0 <= level <= 1.0:
        raise ConfigError(f"Acceptance level {level} is outside [0, 1].")
    return random_pattern(n_drafted, round(level * n_drafted), seed)


def select(variants: list[Variant], only: Sequence[str]) -> list[Variant]:
    """The rows named by ``only`` (row names or groups), plus the target-only baseline; unknown names are an error."""
    if not only:
        return variants
    unknown = [o for o in only if not any(v.group == o or v.name == o for v in variants)]
    if unknown:
        groups = ", ".join(dict.fromkeys(v.group for v in variants))
        raise ConfigError(f"--only: no row or group named {', '.join(map(repr, unknown))}. Groups: {groups}; "
                          "or a row name from the table, e.g. 'scored @75%'.")
    return [v for v in variants if v.group in only or v.name in only or is_baseline(v)]


def is_baseline(v: Variant) -> bool:
    return v.router == "target-only" and v.baseline_key == "recompute/constant"


def configs(v: Variant, s, pattern: tuple[bool, ...] | None):
    """The (RouterConfig, SamplerConfig) of a row under bench settings ``s``."""
    from ..sampling.sampler import SamplerConfig

    if v.router not in ROUTERS:
        raise ConfigError(f"Unknown bench router {v.router!r}; use one of {', '.join(ROUTERS)}.")
    if v.router in ("random", "scored"):
        router = RouterConfig(mode="pattern", pattern=pattern, score_drafts=v.router == "scored", cascade=v.cascade)
    else:
        router = RouterConfig(mode=v.router)
    config = SamplerConfig(
        num_blocks=s.blocks, width=s.width, height=s.height, seed=s.seed,
        cache=CacheConfig(regime=v.regime, window_frames=s.window, sink_frames=s.sinks),
        schedule=v.schedule, pipelined=v.pipelined, refine_from_step=v.refine_from_step, compat=s.compat,
        stitch=v.stitch,
    )
    return router, config
