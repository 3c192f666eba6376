"""One DiT plus its caches for one generation: the few-step block denoiser.

The regime rules (what catching up on history writes, where a block sits, what a denoise leaves behind) live in
the cache policies of ``regimes.py``; :class:`BlockDenoiser` offers them a small cache surface (``call``,
``holds``, ``mark_written``, ``forget_from``) and runs the few-step sampling loop itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..blocks import FRAMES_PER_BLOCK
from ..errors import ConfigError
from ..models.kv_cache import CrossAttnCache, SelfKVCache
from .calls import NO_HOOKS, Hooks
from .history import BlockHistory, DenoiseResult, HistoryBlock
from .prompt_schedule import PromptSchedule
from .regimes import CacheConfig
from .scheduler import BlockNoise, FlowMatchScheduler, renoise, to_eps, to_x0

if TYPE_CHECKING:
    from ..models.dit import CausalWanTransformer

logger = logging.getLogger(__name__)


class BlockDenoiser:
    """One DiT and its self-/cross-attention caches for one generation: ``start``, ``sync``, ``denoise``."""

    def __init__(
        self, model: CausalWanTransformer, cache: CacheConfig, *, name: str,
        scheduler: FlowMatchScheduler | None = None, hooks: Hooks = NO_HOOKS,
    ) -> None:
        self.model = model
        self.cache_config = cache
        self.policy = cache.policy()
        self.name = name
        self.scheduler = scheduler or FlowMatchScheduler()
        self.hooks = hooks
        self.forwards = 0
        # recompute with a re-encoded first frame: history -> the latent of the block's first context frame
        self.first_frame_hook: Callable[[BlockHistory], torch.Tensor] | None = None
        self.kv: SelfKVCache | None = None
        self.cross: CrossAttnCache | None = None
        self.history: BlockHistory | None = None
        # block index -> token of the block whose final (regime-specific) K/V this cache holds
        self._cached: dict[int, int] = {}
        self._num_frames = 0
        # a prompt timeline: each block (denoised or written from history) under its own conditioning
        self.prompts: PromptSchedule | None = None
        self._cross_by_key: dict = {}
        self._key = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        return self.model.execution_device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.compute_dtype

    def start(self, prompt_embeds: torch.Tensor, *, latent_shape: tuple[int, int], num_frames: int) -> None:
        """Preallocate the KV cache (reused if the sizes match) and compute cross-attention K/V once."""
        if num_frames < 1 or num_frames % FRAMES_PER_BLOCK:
            raise ConfigError(f"num_frames must be a positive multiple of {FRAMES_PER_BLOCK}, got {num_frames}.")
        h, w = (int(s) for s in latent_shape)
        batch = int(prompt_embeds.shape[0])
        layout = self.policy.layout(num_frames)
        tpf = self.model.tokens_per_frame(h, w)
        kv = self.kv
        reuse = (
            kv is not None and kv.batch == batch and kv.tokens_per_frame == tpf
            and kv.capacity_frames == layout.capacity_frames and kv.rolling == layout.rolling
            and kv.sink_frames == layout.sink_frames and kv.rope_on_read == layout.rope_on_read
            and kv.k.device == self.device and kv.k.dtype == self.dtype
        )
        if reuse:
            kv.reset()
        else:
            self.kv = None
            self.kv = self.model.new_kv_cache(
                batch=batch, latent_hw=(h, w), capacity_frames=layout.capacity_frames, rolling=layout.rolling,
                sink_frames=layout.sink_frames, rope_on_read=layout.rope_on_read,
            )
            logger.debug("%s: KV cache %d frames (%.1f MB)", self.name, layout.capacity_frames, self.kv.nbytes / 2**20)
        with self.hooks.call("setup"):
            self.cross = self.model.prepare_cross_attention(prompt_embeds)
        self._key = self.prompts.conditioning_key(0) if self.prompts is not None else None
        self._cross_by_key = {self._key: self.cross}
        self._num_frames = num_frames
        self.history = None
        self._cached.clear()
        self.forwards = 0

    def release(self) -> None:
        """Drop the caches and references held for this generation."""
        self.kv = None
        self.cross = None
        self.history = None
        self._cached.clear()
        self._cross_by_key = {}

    def _require_started(self) -> tuple[SelfKVCache, CrossAttnCache]:
        if self.kv is None or self.cross is None:
            raise ConfigError(f"Denoiser '{self.name}' was not started; call start(prompt_embeds, ...) first.")
        return self.kv, self.cross

    # ------------------------------------------------------------------ the cache surface the policies use
    def call(self, x: torch.Tensor, t: float, frame: int) -> torch.Tensor:
        """One forward of the block ``x`` at timestep ``t`` and RoPE frame ``frame``, writing its K/V."""
        kv, cross = self._require_started()
        x = self.prep(x)
        tt = torch.full((x.shape[0], x.shape[2]), float(t), device=x.device, dtype=torch.float32)
        with self.hooks.call(self.name, (int(frame), int(x.shape[2]), True)):
            v = self.model.forward_block(x, tt, kv, cross, frame_offset=frame, write=True)
        self.forwards += 1
        return v

    def prep(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    def holds(self, hb: HistoryBlock) -> bool:
        """Whether the cache holds exactly this committed block's final K/V (by token)."""
        return self._cached.get(hb.index) == hb.token

    def mark_written(self, block: int, token: int | None) -> None:
        """A write of ``block`` drops the block's later frames from the cache: forget them."""
        self.forget_from(block)
        if token is not None:
            self._cached[block] = token

    def forget_from(self, block: int) -> None:
        for i in [i for i in self._cached if i >= block]:
            del self._cached[i]

    def first_frame(self, history: BlockHistory) -> torch.Tensor | None:
        return self.first_frame_hook(history) if self.first_frame_hook is not None else None

    def condition_on(self, block: int) -> None:
        """Use ``block``'s conditioning for the next forwards: its cross-attention K/V are computed once per
        distinct conditioning (a prompt switch, or a blend step) and kept while they may be needed again."""
        if self.prompts is None:
            return
        key = self.prompts.conditioning_key(block)
        if key == self._key:
            return
        cross = self._cross_by_key.get(key)
        if cross is None:
            with self.hooks.call("setup"):
                cross = self.model.prepare_cross_attention(self.prompts.embeds_for(key).to(self.device))
            self._cross_by_key[key] = cross
            while len(self._cross_by_key) > 3:  # the older prompt of a lagging or pipelined cache, and the new one
                del self._cross_by_key[next(iter(self._cross_by_key))]
        self.cross, self._key = cross, key

    # ------------------------------------------------------------------ sync / denoise
    def sync(self, history: BlockHistory) -> int:
        """Deferred cache work for history blocks not yet in this cache; returns the number of forwards.

        A block is (re)written when the cache does not hold that exact block (by token): new blocks, and blocks
        that replaced a draft this cache saw (e.g. a speculative history followed by a rejection).
        """
        self._require_started()
        self.history = history
        before = self.forwards
        with torch.inference_mode():
            self.policy.catch_up(self)
        return self.forwards - before

    def _check_denoise_args(self, block, noise, timesteps, start_step, x0_init) -> int:
        n = len(timesteps)
        if n < 1:
            raise ConfigError("denoise needs at least one timestep.")
        if len(noise.renoise) < n - 1:
            raise ConfigError(f"Block noise has {len(noise.renoise)} re-noise tensors; {n - 1} are needed.")
        if not 0 <= start_step <= n or (start_step == n and x0_init is None):
            raise ConfigError(f"start_step {start_step} is outside 0..{n - 1}.")
        if start_step > 0 and x0_init is None:
            raise ConfigError("Refine-on-reject (start_step > 0) needs x0_init.")
        if (block + 1) * FRAMES_PER_BLOCK > self._num_frames:
            raise ConfigError(f"Block {block} is beyond the {self._num_frames} frames given to start().")
        if self.policy.needs_cached_history() and any(i not in self._cached for i in range(block)):
            raise ConfigError(f"Denoiser '{self.name}' is missing blocks before {block}; call sync(history) first.")
        return n

    def denoise(
        self, block: int, noise: BlockNoise, timesteps: list[float], *, start_step: int = 0,
        x0_init: torch.Tensor | None = None, on_step: Callable[[int, int], None] | None = None,
        keep_x0_step: int | None = None, step_noise: str = "fresh",
    ) -> DenoiseResult:
        """Few-step denoise of one block from ``noise`` (or refine from ``x0_init`` at ``start_step``; ``start_step =
        len(timesteps)`` keeps ``x0_init`` as it is: video-to-video at strength 0).

        ``on_step(i, n)`` runs before each denoising call (not before the recompute context refill); an exception
        it raises (``CancelledError``) propagates. ``forwards`` in the result includes the refill. ``keep_x0_step``:
        the result keeps that step's x0 prediction (``x0_kept``; step stitch hands it to the target). ``step_noise``:
        re-noise between steps with the block's fresh noise, or with the noise the model predicts ("predicted": Euler
        steps of the flow ODE).
        """
        self._require_started()
        n = self._check_denoise_args(block, noise, timesteps, start_step, x0_init)
        before = self.forwards
        sigmas = [self.scheduler.step_sigma(t) for t in timesteps]
        with torch.inference_mode():
            self.condition_on(block)
            frame = self.policy.place_block(self, block)
            if start_step == 0:
                x = self.prep(noise.initial)
            elif start_step == n:  # nothing to denoise: the block is x0_init, written clean if the cache keeps it
                x = self.prep(x0_init)
                if self.policy.keeps_denoised_block:
                    self.call(x, 0.0, frame)
            else:
                x = renoise(self.prep(x0_init), self.prep(noise.renoise[start_step - 1]), sigmas[start_step])
            x0 = x
            kept = None
            for i in range(start_step, n):
                if on_step is not None:
                    on_step(i, n)
                v = self.call(x, timesteps[i], frame)
                x0 = to_x0(x, v, sigmas[i])
                if i == keep_x0_step:
                    kept = x0
                if i < n - 1:
                    eps = to_eps(x, v, sigmas[i]) if step_noise == "predicted" else self.prep(noise.renoise[i])
                    x = renoise(x0, eps, sigmas[i + 1])
        last_t = float(timesteps[n - 1]) if start_step < n else 0.0
        result = DenoiseResult(x0=x0, last_noisy=x, last_t=last_t, forwards=self.forwards - before, x0_kept=kept)
        self.policy.after_denoise(self, block, result.token)
        return result
