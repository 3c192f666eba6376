"""KV-cache regimes: one policy object per regime, behind one small interface (SPEC §2).

- ``global`` (Self-Forcing / CausVid): K/V at absolute frame positions; after a block, one t = 0 forward on its
  clean latents (the "clean pass") overwrites its slots. The clean pass is deferred: it runs when the model next
  needs its cache (catching up on history), so the last block never pays it.
- ``recompute`` (Krea, SDVG reference): before each block ≥ 1 the cache is reset and refilled with one t = 0
  forward over three context frames (a first frame, then the last two latent frames); the block sits at
  window-relative frames 3..5. Nothing to catch up on. The first frame is either an old decoded pixel frame
  re-encoded as an image (Krea, ``first_frame="reencode"``) or simply latent frame 0 (``"latent"``).
- ``noisy`` (Diagonal forcing, LongLive): no clean pass; the K/V of a block's last denoising call are its final
  K/V. Rolling window with pinned sinks (LongLive: the first ``sink_frames`` frames ever written stay), RoPE at
  absolute positions or at window-relative ones (``positions="window"``: any length). Blocks made by the other
  model are written with one forward on their last noisy input at their last timestep.

:class:`CacheConfig` is what users set (CLI, nodes, API); :meth:`CacheConfig.policy` gives the behaviour. The
denoiser, the sampler's time estimate and the bench's analytic call counts all ask the policy; none keeps its
own copy of a regime rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol

import torch

from ..blocks import FRAMES_PER_BLOCK
from ..errors import ConfigError
from ..models.kv_cache import SelfKVCache
from .history import BlockHistory, HistoryBlock

CONTEXT_FRAMES = 3  # recompute: first frame + last 2 latent frames
FIRST_FRAME_SOURCES = ("reencode", "latent")
POSITIONS = ("absolute", "window")  # RoPE frame positions of the noisy regime's cache


class CacheRegime(str, Enum):
    GLOBAL = "global"
    RECOMPUTE = "recompute"
    NOISY = "noisy"


REGIMES = tuple(r.value for r in CacheRegime)


@dataclass
class CacheConfig:
    """The cache settings. ``window_frames``/``sink_frames``/``positions`` apply to ``noisy``; ``first_frame`` to
    ``recompute``.

    ``positions``: ``"absolute"`` ropes every frame at its frame index in the video (what the models were trained
    with; the video may not outgrow the model's RoPE table), ``"window"`` at its slot in the rolling window (sinks
    first), so any length fits: the cache stores un-roped keys and ropes the window on every read. Recompute's
    positions are always window-relative (the block sits at frames 3..5), global's always absolute.
    """

    regime: CacheRegime = CacheRegime.RECOMPUTE
    window_frames: int = 12
    sink_frames: int = 3
    first_frame: str = "reencode"
    positions: str = "absolute"

    def __post_init__(self) -> None:
        try:
            self.regime = CacheRegime(self.regime)
        except ValueError as exc:
            raise ConfigError(f"Unknown cache regime {self.regime!r}; use one of: {', '.join(REGIMES)}.") from exc
        for name in ("window_frames", "sink_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}.")
        if self.sink_frames < 0:
            raise ConfigError(f"sink_frames must be >= 0, got {self.sink_frames}.")
        if self.window_frames < self.sink_frames + FRAMES_PER_BLOCK:
            raise ConfigError(
                f"window_frames ({self.window_frames}) must be at least sink_frames + {FRAMES_PER_BLOCK} "
                f"(= {self.sink_frames + FRAMES_PER_BLOCK})."
            )
        if self.first_frame not in FIRST_FRAME_SOURCES:
            raise ConfigError(f"first_frame must be one of {', '.join(FIRST_FRAME_SOURCES)}, got {self.first_frame!r}.")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}.")
        if self.positions == "window" and self.regime == CacheRegime.GLOBAL:
            raise ConfigError("The global cache keeps every frame at its absolute RoPE position; window-relative "
                              "positions need a rolling window: use the noisy regime (or recompute).")

    def policy(self) -> CachePolicy:
        return _POLICIES[self.regime](self)


@dataclass(frozen=True)
class CacheLayout:
    """How a denoiser's self-attention cache is allocated for a video of ``num_frames`` latent frames."""

    capacity_frames: int
    rolling: bool = False
    sink_frames: int = 0
    rope_on_read: bool = False  # keys stored un-roped, roped at their window slot on every read


class CacheSurface(Protocol):
    """What a policy may do to a denoiser (``causal.BlockDenoiser`` offers it)."""

    name: str
    kv: SelfKVCache | None
    history: BlockHistory | None

    def call(self, x: torch.Tensor, t: float, frame: int) -> torch.Tensor: ...

    def prep(self, x: torch.Tensor) -> torch.Tensor: ...

    def holds(self, hb: HistoryBlock) -> bool: ...

    def mark_written(self, block: int, token: int | None) -> None: ...

    def forget_from(self, block: int) -> None: ...

    def first_frame(self, history: BlockHistory) -> torch.Tensor | None: ...

    def condition_on(self, block: int) -> None: ...


class CachePolicy:
    """The rules of one regime. The methods that take a denoiser act on it through its :class:`CacheSurface`."""

    regime: ClassVar[CacheRegime]
    #: catching up writes committed history blocks this cache does not hold (one forward each)
    writes_history: ClassVar[bool] = False
    #: the last denoising call's K/V are the block's final K/V (no write needed for the model's own blocks)
    keeps_denoised_block: ClassVar[bool] = False

    def __init__(self, config: CacheConfig) -> None:
        self.config = config

    # ---- sizes -------------------------------------------------------------------------------------------
    def layout(self, num_frames: int) -> CacheLayout:
        raise NotImplementedError

    def check_length(self, num_frames: int, rope_frames: int) -> None:
        """Refuse videos the regime cannot position (only the global regime has absolute positions to run out of)."""

    @property
    def reencodes_first_frame(self) -> bool:
        """Whether blocks need a decoded pixel frame re-encoded as context (recompute, Krea's first frame)."""
        return False

    # ---- costs (the sampler's target-only estimate and the bench's analytic call counts) --------------------
    def refill_forwards(self, block: int) -> int:
        """Forwards that rebuild the cache before a block's denoising steps (recompute: one, from block 1)."""
        return 0

    def context_encodes(self, block: int) -> int:
        """Pixel frames re-encoded as context for ``block`` (one per block, shared by both models)."""
        return 0

    def target_only_cache_forwards(self, block: int) -> int:
        """Cache forwards of block ``block`` in a run where one model makes every block."""
        own_write = 1 if self.writes_history and not self.keeps_denoised_block and block >= 1 else 0
        return self.refill_forwards(block) + own_write

    # ---- acting on a denoiser ------------------------------------------------------------------------------
    def catch_up(self, den: CacheSurface) -> None:
        """Write the committed blocks of ``den.history`` that the cache does not hold yet (deferred work)."""
        if not self.writes_history:
            return
        for hb in den.history.blocks:
            if not den.holds(hb):
                x, t = self.history_input(hb)
                den.condition_on(hb.index)  # a block's K/V are written under its own prompt
                den.call(x, t, hb.index * FRAMES_PER_BLOCK)
                den.mark_written(hb.index, hb.token)

    def history_input(self, hb: HistoryBlock):
        """The model input and timestep that write a history block's final K/V."""
        return hb.x0, 0.0

    def needs_cached_history(self) -> bool:
        return self.writes_history

    def needed_from(self, den: CacheSurface, history: BlockHistory) -> int:
        """The oldest history block ``den`` may still read (older ones can be dropped on long videos): the first
        one its cache does not hold yet, or only the last block when the cache is rebuilt from the tail."""
        if not self.writes_history:
            return max(len(history) - 1, 0)
        return next((hb.index for hb in history.blocks if not den.holds(hb)), len(history))

    def place_block(self, den: CacheSurface, block: int) -> int:
        """Prepare the cache for denoising ``block``; returns the block's RoPE frame offset."""
        den.forget_from(block)  # the block's slots (and later frames) are about to change
        return block * FRAMES_PER_BLOCK

    def after_denoise(self, den: CacheSurface, block: int, token: int) -> None:
        if self.keeps_denoised_block:
            den.mark_written(block, token)


class GlobalCache(CachePolicy):
    regime = CacheRegime.GLOBAL
    writes_history = True

    def layout(self, num_frames: int) -> CacheLayout:
        return CacheLayout(num_frames)

    def check_length(self, num_frames: int, rope_frames: int) -> None:
        if num_frames > rope_frames:
            raise ConfigError(
                f"{num_frames // FRAMES_PER_BLOCK} blocks ({num_frames} latent frames) exceed the RoPE range of "
                f"{rope_frames} frames under the global cache. Use the recompute or noisy regime for long videos."
            )


class RecomputeCache(CachePolicy):
    regime = CacheRegime.RECOMPUTE

    def layout(self, num_frames: int) -> CacheLayout:
        return CacheLayout(CONTEXT_FRAMES + FRAMES_PER_BLOCK)

    @property
    def reencodes_first_frame(self) -> bool:
        return self.config.first_frame == "reencode"

    def refill_forwards(self, block: int) -> int:
        return 1 if block >= 1 else 0

    def context_encodes(self, block: int) -> int:
        # the first context frame is taken apart from the tail once the history is longer than the context
        return 1 if self.reencodes_first_frame and block * FRAMES_PER_BLOCK > CONTEXT_FRAMES else 0

    def place_block(self, den: CacheSurface, block: int) -> int:
        """Reset and refill the cache from the history; the block sits right after its context frames."""
        den.kv.reset()
        if block == 0:
            return 0
        hist = den.history
        if hist is None or len(hist) < block:
            raise ConfigError(f"Denoiser '{den.name}' has no history for block {block}; call sync(history) first.")
        total = hist.num_frames(block)
        if total <= CONTEXT_FRAMES:
            ctx = den.prep(hist.tail_frames(total, block))
        else:
            first = den.first_frame(hist) if self.reencodes_first_frame else None
            if first is None:
                first = hist.first_latent_frame()
            ctx = torch.cat([den.prep(first), den.prep(hist.tail_frames(CONTEXT_FRAMES - 1, block))], dim=2)
        den.call(ctx, 0.0, 0)
        return ctx.shape[2]


class NoisyCache(CachePolicy):
    regime = CacheRegime.NOISY
    writes_history = True
    keeps_denoised_block = True

    def layout(self, num_frames: int) -> CacheLayout:
        cfg = self.config
        relative = cfg.positions == "window"
        if num_frames <= cfg.window_frames:
            return CacheLayout(num_frames, rope_on_read=relative)
        return CacheLayout(cfg.window_frames, rolling=True, sink_frames=cfg.sink_frames, rope_on_read=relative)

    def check_length(self, num_frames: int, rope_frames: int) -> None:
        cfg = self.config
        if cfg.positions == "window":
            if min(num_frames, cfg.window_frames) > rope_frames:
                raise ConfigError(f"window_frames ({cfg.window_frames}) exceeds the model's RoPE range of {rope_frames} "
                                  "frames; use a smaller window.")
        elif num_frames > rope_frames:
            raise ConfigError(
                f"{num_frames // FRAMES_PER_BLOCK} blocks ({num_frames} latent frames) exceed the RoPE range of "
                f"{rope_frames} frames at absolute positions. Use window-relative positions (--positions window / "
                "positions='window') or the recompute regime for long videos."
            )

    def history_input(self, hb: HistoryBlock):
        if hb.last_noisy is None:
            return hb.x0, 0.0
        return hb.last_noisy, hb.last_t


_POLICIES: dict[CacheRegime, type[CachePolicy]] = {
    CacheRegime.GLOBAL: GlobalCache,
    CacheRegime.RECOMPUTE: RecomputeCache,
    CacheRegime.NOISY: NoisyCache,
}
