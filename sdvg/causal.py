"""One DiT plus its caches for one generation: cache regimes, block history, and the few-step block denoiser.

Regimes (SPEC §2):
- ``GLOBAL``: absolute frame positions; ``sync`` runs the clean pass (one t=0 forward on x0) per new block.
- ``RECOMPUTE`` (Krea): ``denoise(b)`` resets the cache and refills it with one t=0 forward over
  [first frame, last 2 latent frames]; the block sits at window-relative frames 3..5. ``sync`` only records
  the history.
- ``NOISY`` (Diagonal forcing): no clean pass; the cache keeps the K/V of the block's last denoising call;
  rolling window with pinned sinks (absolute RoPE positions, LongLive style). ``sync`` writes blocks produced
  elsewhere with one forward on their last noisy input at their last timestep.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from .dit import CausalWanTransformer
from .errors import ConfigError
from .kv_cache import CrossAttnCache, SelfKVCache
from .scheduler import BlockNoise, FlowMatchScheduler, renoise, to_x0

logger = logging.getLogger(__name__)

FRAMES_PER_BLOCK = 3
CONTEXT_FRAMES = 3  # RECOMPUTE: first frame + last 2 latent frames
_TOKENS = itertools.count(1)


class CacheRegime(str, Enum):
    GLOBAL = "global"
    RECOMPUTE = "recompute"
    NOISY = "noisy"


@dataclass
class CacheConfig:
    """Cache regime; ``window_frames``/``sink_frames`` apply to ``NOISY`` (rolling window with pinned sinks)."""

    regime: CacheRegime = CacheRegime.RECOMPUTE
    window_frames: int = 12
    sink_frames: int = 3

    def __post_init__(self) -> None:
        try:
            self.regime = CacheRegime(self.regime)
        except ValueError as exc:
            names = ", ".join(r.value for r in CacheRegime)
            raise ConfigError(f"Unknown cache regime {self.regime!r}; use one of: {names}.") from exc
        if self.sink_frames < 0:
            raise ConfigError(f"sink_frames must be >= 0, got {self.sink_frames}.")
        if self.window_frames < self.sink_frames + FRAMES_PER_BLOCK:
            raise ConfigError(
                f"window_frames ({self.window_frames}) must be at least sink_frames + {FRAMES_PER_BLOCK} "
                f"(= {self.sink_frames + FRAMES_PER_BLOCK})."
            )


@dataclass
class HistoryBlock:
    """A finished block: its clean latents, its last noisy model input and timestep, and the result token."""

    index: int
    x0: torch.Tensor
    last_noisy: torch.Tensor | None
    last_t: float
    token: int


class BlockHistory:
    """The committed blocks of one generation, in order."""

    def __init__(self) -> None:
        self.blocks: list[HistoryBlock] = []

    def append(self, block: HistoryBlock) -> None:
        if block.index != len(self.blocks):
            raise ConfigError(f"History expects block {len(self.blocks)} next, got block {block.index}.")
        self.blocks.append(block)

    def __len__(self) -> int:
        return len(self.blocks)

    def extended(self, block: HistoryBlock) -> BlockHistory:
        """A new history: these blocks plus ``block`` (e.g. a speculative, not yet accepted draft)."""
        out = BlockHistory()
        out.blocks = [*self.blocks, block]
        if block.index != len(self.blocks):
            raise ConfigError(f"History expects block {len(self.blocks)} next, got block {block.index}.")
        return out

    def latents(self) -> torch.Tensor:
        """All clean latents ``[B, 16, F, h, w]``."""
        if not self.blocks:
            raise ConfigError("The block history is empty.")
        return torch.cat([b.x0 for b in self.blocks], dim=2)

    def num_frames(self, upto: int | None = None) -> int:
        return sum(b.x0.shape[2] for b in self.blocks[:upto])

    def tail_frames(self, n: int, upto: int | None = None) -> torch.Tensor:
        """The last ``n`` latent frames of blocks ``[0, upto)`` (fewer if the history is shorter)."""
        parts: list[torch.Tensor] = []
        need = n
        for b in reversed(self.blocks[:upto]):
            if need <= 0:
                break
            take = min(need, b.x0.shape[2])
            parts.append(b.x0[:, :, b.x0.shape[2] - take:])
            need -= take
        return torch.cat(parts[::-1], dim=2)


@dataclass
class DenoiseResult:
    x0: torch.Tensor
    last_noisy: torch.Tensor
    last_t: float
    forwards: int
    token: int = field(default_factory=lambda: next(_TOKENS))


class BlockDenoiser:
    """One DiT and its self-/cross-attention caches for one generation: ``start``, ``sync``, ``denoise``."""

    def __init__(
        self, model: CausalWanTransformer, cache: CacheConfig, *, name: str,
        scheduler: FlowMatchScheduler | None = None,
    ) -> None:
        self.model = model
        self.cache_config = cache
        self.name = name
        self.scheduler = scheduler or FlowMatchScheduler()
        self.forwards = 0
        self.first_frame_hook: Callable[[BlockHistory], torch.Tensor] | None = None
        self.kv: SelfKVCache | None = None
        self.cross: CrossAttnCache | None = None
        self._history: BlockHistory | None = None
        # block index -> token of the block whose final (regime-specific) K/V this cache holds
        self._cached: dict[int, int] = {}
        self._batch = 1
        self._num_frames = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        return self.model.execution_device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.compute_dtype

    def _capacity(self, num_frames: int) -> tuple[int, bool, int]:
        cfg = self.cache_config
        if cfg.regime is CacheRegime.GLOBAL:
            return num_frames, False, 0
        if cfg.regime is CacheRegime.RECOMPUTE:
            return CONTEXT_FRAMES + FRAMES_PER_BLOCK, False, 0
        if num_frames <= cfg.window_frames:
            return num_frames, False, 0
        return cfg.window_frames, True, cfg.sink_frames

    def start(self, prompt_embeds: torch.Tensor, *, latent_shape: tuple[int, int], num_frames: int) -> None:
        """Preallocate the KV cache (reused if the sizes match) and compute cross-attention K/V once."""
        if num_frames < 1 or num_frames % FRAMES_PER_BLOCK:
            raise ConfigError(f"num_frames must be a positive multiple of {FRAMES_PER_BLOCK}, got {num_frames}.")
        h, w = (int(s) for s in latent_shape)
        batch = int(prompt_embeds.shape[0])
        cap, rolling, sinks = self._capacity(num_frames)
        tpf = self.model.tokens_per_frame(h, w)
        kv = self.kv
        reuse = (
            kv is not None and kv.batch == batch and kv.tokens_per_frame == tpf and kv.capacity_frames == cap
            and kv.rolling == rolling and kv.sink_frames == sinks and kv.k.device == self.device
            and kv.k.dtype == self.dtype
        )
        if reuse:
            kv.reset()
        else:
            self.kv = None
            self.kv = self.model.new_kv_cache(
                batch=batch, latent_hw=(h, w), capacity_frames=cap, rolling=rolling, sink_frames=sinks
            )
            logger.debug("%s: KV cache %d frames (%.1f MB)", self.name, cap, self.kv.nbytes / 2**20)
        self.cross = self.model.prepare_cross_attention(prompt_embeds)
        self._batch = batch
        self._num_frames = num_frames
        self._history = None
        self._cached.clear()
        self.forwards = 0

    def release(self) -> None:
        """Drop the caches and references held for this generation."""
        self.kv = None
        self.cross = None
        self._history = None
        self._cached.clear()

    def _require_started(self) -> tuple[SelfKVCache, CrossAttnCache]:
        if self.kv is None or self.cross is None:
            raise ConfigError(f"Denoiser '{self.name}' was not started; call start(prompt_embeds, ...) first.")
        return self.kv, self.cross

    # ------------------------------------------------------------------ model calls
    def _call(self, x: torch.Tensor, t: float, frame: int, *, write: bool = True) -> torch.Tensor:
        kv, cross = self._require_started()
        tt = torch.full((x.shape[0], x.shape[2]), float(t), device=x.device, dtype=torch.float32)
        v = self.model.forward_block(x, tt, kv, cross, frame_offset=frame, write=write)
        self.forwards += 1
        return v

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ sync / denoise
    def _mark_written(self, block: int, token: int | None) -> None:
        """A write of ``block`` drops the block's later frames from the cache: forget them."""
        for i in [i for i in self._cached if i >= block]:
            del self._cached[i]
        if token is not None:
            self._cached[block] = token

    def sync(self, history: BlockHistory) -> int:
        """Deferred cache work for history blocks not yet in this cache; returns the number of forwards.

        A block is (re)written when the cache does not hold that exact block (by token): new blocks, and blocks
        that replaced a draft this cache saw (e.g. a speculative history followed by a rejection).
        """
        self._require_started()
        self._history = history
        regime = self.cache_config.regime
        if regime is CacheRegime.RECOMPUTE:
            return 0
        before = self.forwards
        with torch.inference_mode():
            for hb in history.blocks:
                if self._cached.get(hb.index) == hb.token:
                    continue  # already holds exactly this block (NOISY: our own last call wrote it)
                frame = hb.index * FRAMES_PER_BLOCK
                if regime is CacheRegime.GLOBAL or hb.last_noisy is None:
                    self._call(self._prep(hb.x0), 0.0, frame)
                else:
                    self._call(self._prep(hb.last_noisy), hb.last_t, frame)
                self._mark_written(hb.index, hb.token)
        return self.forwards - before

    def _recompute_context(self, block: int) -> int:
        """RECOMPUTE: reset and refill the cache from the history; returns the block's window-relative frame."""
        kv, _ = self._require_started()
        kv.reset()
        if block == 0:
            return 0
        hist = self._history
        if hist is None or len(hist) < block:
            raise ConfigError(
                f"Denoiser '{self.name}' has no history for block {block}; call sync(history) before denoise."
            )
        total = hist.num_frames(block)
        if total <= CONTEXT_FRAMES:
            ctx = hist.tail_frames(total, block)
        else:
            first = self.first_frame_hook(hist) if self.first_frame_hook is not None else hist.blocks[0].x0[:, :, :1]
            tail = hist.tail_frames(CONTEXT_FRAMES - 1, block)
            ctx = torch.cat([self._prep(first), self._prep(tail)], dim=2)
        self._call(self._prep(ctx), 0.0, 0)
        return ctx.shape[2]

    def _check_denoise_args(self, block, noise, timesteps, start_step, x0_init) -> int:
        n = len(timesteps)
        if n < 1:
            raise ConfigError("denoise needs at least one timestep.")
        if len(noise.renoise) < n - 1:
            raise ConfigError(f"Block noise has {len(noise.renoise)} re-noise tensors; {n - 1} are needed.")
        if not 0 <= start_step < n:
            raise ConfigError(f"start_step {start_step} is outside 0..{n - 1}.")
        if start_step > 0 and x0_init is None:
            raise ConfigError("Refine-on-reject (start_step > 0) needs x0_init.")
        if (block + 1) * FRAMES_PER_BLOCK > self._num_frames:
            raise ConfigError(f"Block {block} is beyond the {self._num_frames} frames given to start().")
        if self.cache_config.regime is not CacheRegime.RECOMPUTE and any(i not in self._cached for i in range(block)):
            raise ConfigError(f"Denoiser '{self.name}' is missing blocks before {block}; call sync(history) first.")
        return n

    def denoise(
        self, block: int, noise: BlockNoise, timesteps: list[float], *, start_step: int = 0,
        x0_init: torch.Tensor | None = None, on_step: Callable[[int, int], None] | None = None,
    ) -> DenoiseResult:
        """Few-step denoise of one block from ``noise`` (or refine from ``x0_init`` at ``start_step``).

        ``on_step(i, n)`` runs before each denoising call (not before the RECOMPUTE context refill); an exception
        it raises (``CancelledError``) propagates. ``forwards`` in the result includes the refill.
        """
        self._require_started()
        n = self._check_denoise_args(block, noise, timesteps, start_step, x0_init)
        before = self.forwards
        sched = self.scheduler
        sigmas = [sched.sigma_of(t) for t in timesteps]
        with torch.inference_mode():
            if self.cache_config.regime is CacheRegime.RECOMPUTE:
                frame = self._recompute_context(block)
            else:
                frame = block * FRAMES_PER_BLOCK
                self._mark_written(block, None)  # the block's slots (and later frames) are about to change
            if start_step == 0:
                x = self._prep(noise.initial)
            else:
                x = renoise(self._prep(x0_init), self._prep(noise.renoise[start_step - 1]), sigmas[start_step])
            x0 = x
            for i in range(start_step, n):
                if on_step is not None:
                    on_step(i, n)
                v = self._call(x, timesteps[i], frame)
                x0 = to_x0(x, v, sigmas[i])
                if i < n - 1:
                    x = renoise(x0, self._prep(noise.renoise[i]), sigmas[i + 1])
        result = DenoiseResult(x0=x0, last_noisy=x, last_t=float(timesteps[n - 1]), forwards=self.forwards - before)
        if self.cache_config.regime is CacheRegime.NOISY:
            self._cached[block] = result.token  # the last noisy call's K/V are this block's final K/V
        return result
