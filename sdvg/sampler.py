"""The speculative block sampler (SDVG) with Diagonal-Distillation sampling options.

Per block b (SPEC §1):

1. sample the block's initial noise ``z_b`` and re-noise tensors ``ε_b,*`` from the seeded generator;
2. block 0 (or a block the router forces) goes to the target, no draft is wasted on it;
3. otherwise the drafter denoises the block, the VAE state is snapshotted, the draft is decoded and scored;
4. accept → the draft's latents, pixels and VAE state are kept;
5. reject → the VAE state is restored and the target regenerates from the same ``z_b`` and ``ε_b,*``;
6. the winning latents become context for both models (each model's cache catches up lazily, when it next runs).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from .causal import BlockDenoiser, BlockHistory, CacheConfig, CacheRegime, DenoiseResult, HistoryBlock
from .errors import CancelledError, ConfigError
from .pipeline import SDVGModels
from .router import Router, RouterConfig, RouteRecord
from .scheduler import FlowMatchScheduler, build_step_schedule, sample_block_noise

logger = logging.getLogger(__name__)

FRAMES_PER_BLOCK = 3
LATENT_CHANNELS = 16
VAE_SCALE = 8
SPATIAL_MULTIPLE = 16  # VAE ×8 then DiT patch ×2
EARLY_EXIT_CHUNK = 3  # frames scored per forward when the router may stop at the first frame below τ


def pixel_frames_for_blocks(num_blocks: int) -> int:
    """Block 0 decodes to 9 frames, every later block to 12."""
    return 12 * num_blocks - 3


def blocks_for_frames(num_frames: int) -> int:
    """The fewest blocks that give at least ``num_frames`` pixel frames."""
    return max(1, math.ceil((num_frames + 3) / 12))


@dataclass
class SamplerConfig:
    num_blocks: int = 7
    width: int = 832
    height: int = 480
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    schedule: str | Sequence[Sequence[float]] = "constant"
    pipelined: bool = False
    refine_from_step: int | None = None
    num_frames: int | None = None  # trim the output to this many pixel frames
    # Recompute regime: the first context frame is the oldest of the last 9 decoded pixel frames re-encoded as a
    # standalone image (Krea, "image-like" as in training) or simply latent frame 0 ("latent").
    first_frame: str = "reencode"
    output_dtype: str = "float"  # "float" ([0,1] float32) or "uint8"


@dataclass
class StepEvent:
    block: int
    model: str
    step: int
    num_steps: int


@dataclass
class BlockRecord:
    """One finished block. ``timings`` are seconds per phase (draft, decode, score, target, cache, output); in
    pipelined mode decode and score of a draft ran on the worker while the main thread drafted the next block,
    so the phases can add up to more than the block's wall time (``verify_wait`` is what the main thread waited)."""

    block: int
    decision: str
    reason: str
    produced_by: str
    steps: int
    q: float | None = None
    scores: list[float] = field(default_factory=list)
    tau: float | None = None
    aggregation: str | None = None
    drafted: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    forwards: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("q", "tau"):
            value = out[key]
            if value is not None and not math.isfinite(value):
                out[key] = "inf" if value > 0 else "-inf"
        return out


@dataclass
class BlockEvent:
    block: int
    frames: torch.Tensor  # [N, H, W, 3] float32 in [0, 1], on the CPU
    record: BlockRecord


@dataclass
class SDVGResult:
    frames: torch.Tensor
    latents: torch.Tensor
    blocks: list[BlockRecord]
    partial: bool
    totals: dict
    settings: dict

    def report(self) -> dict:
        return {
            "settings": self.settings,
            "partial": self.partial,
            "totals": self.totals,
            "blocks": [b.to_dict() for b in self.blocks],
        }


class _Timer:
    """Accumulates wall time per phase. On CUDA it synchronizes the phase's device first, so GPU time lands in
    the phase that queued it (the router needs scores on the host anyway, so this costs little)."""

    @staticmethod
    @contextmanager
    def phase(name: str, into: dict[str, float], device: torch.device | None = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            into[name] = into.get(name, 0.0) + time.perf_counter() - start


@dataclass
class _Draft:
    block: int
    result: DenoiseResult
    history_block: HistoryBlock


class SpeculativeSampler:
    """Generates a video block by block with a drafter, a target and a reward router.

    ``generate`` is a generator: it yields a :class:`BlockEvent` per finished block and returns the
    :class:`SDVGResult` (``StopIteration.value``); ``run`` consumes it for you.
    """

    def __init__(self, models: SDVGModels, router: RouterConfig, config: SamplerConfig):
        self.models = models
        self.config = config
        self.router_config = router
        self.check_inputs()
        # The router's target-rate correction needs the block count; never mutate the caller's config.
        self.router_config = replace(router, num_blocks=config.num_blocks)
        self.router_config.validate()
        self.scheduler = FlowMatchScheduler()
        self.schedule = build_step_schedule(config.schedule, config.num_blocks, self.scheduler)

    # ------------------------------------------------------------------ validation
    def check_inputs(self) -> None:
        cfg, models, mode = self.config, self.models, self.router_config.mode
        for name in ("width", "height", "num_blocks", "seed"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}.")
        if cfg.width <= 0 or cfg.height <= 0 or cfg.width % SPATIAL_MULTIPLE or cfg.height % SPATIAL_MULTIPLE:
            raise ConfigError(
                f"Width and height must be positive multiples of {SPATIAL_MULTIPLE}, got {cfg.width}×{cfg.height}. "
                f"Try {max(16, round(cfg.width / 16) * 16)}×{max(16, round(cfg.height / 16) * 16)}."
            )
        if cfg.num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {cfg.num_blocks}.")
        if not 0 <= cfg.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {cfg.seed}.")
        if cfg.num_frames is not None and not 1 <= cfg.num_frames <= pixel_frames_for_blocks(cfg.num_blocks):
            raise ConfigError(f"num_frames {cfg.num_frames} does not fit {cfg.num_blocks} blocks.")
        if cfg.first_frame not in ("reencode", "latent"):
            raise ConfigError(f"first_frame must be 'reencode' or 'latent', got {cfg.first_frame!r}.")
        if cfg.output_dtype not in ("float", "uint8"):
            raise ConfigError(f"output_dtype must be 'float' or 'uint8', got {cfg.output_dtype!r}.")
        needs_draft = mode != "target-only"
        needs_target = mode != "draft-only"
        if needs_target and models.target is None:
            raise ConfigError(f"Routing mode '{mode}' needs a target model; none was given.")
        if needs_draft and models.drafter is None:
            raise ConfigError(f"Routing mode '{mode}' needs a drafter model; none was given.")
        if mode == "reward" and models.reward is None:
            raise ConfigError("Routing mode 'reward' needs a reward model (ImageReward); none was given.")
        if cfg.pipelined and mode == "target-only":
            raise ConfigError("Pipelined verification needs a drafter; it does nothing in target-only mode.")
        if cfg.pipelined and torch.device(getattr(models.vae, "device", "cpu")).type != "cuda":
            logger.warning(
                "Pipelined verification overlaps decode+score with drafting well only when the VAE and reward run "
                "on a CUDA device; on the CPU the two threads share the cores and it is usually slower."
            )
        if cfg.refine_from_step is not None and cfg.refine_from_step < 1:
            raise ConfigError("refine_from_step must be ≥ 1 (step 0 would be a full regeneration).")
        dits = [m for m in (models.target, models.drafter) if m is not None]
        for m in dits:
            self._check_dit_fits(m)
        if len(dits) == 2:
            a, b = (m.config for m in dits)
            for key in ("in_channels", "out_channels", "patch_size", "text_dim"):
                if tuple(_as_tuple(a[key])) != tuple(_as_tuple(b[key])):
                    raise ConfigError(
                        f"Drafter and target do not match: {key} is {b[key]} for the drafter and {a[key]} for the "
                        "target. Both must be Wan 2.1 T2V DiTs sharing the latent space and the text encoder."
                    )

    def _check_dit_fits(self, model: torch.nn.Module) -> None:
        cfg = self.config
        rope_len = int(model.config.get("rope_max_seq_len", 1024))
        p_t, p_h, p_w = _as_tuple(model.config["patch_size"])
        h_tokens = cfg.height // VAE_SCALE // p_h
        w_tokens = cfg.width // VAE_SCALE // p_w
        if max(h_tokens, w_tokens) > rope_len:
            raise ConfigError(f"{cfg.width}×{cfg.height} exceeds the model's RoPE range ({rope_len} tokens per axis).")
        frames = cfg.num_blocks * FRAMES_PER_BLOCK
        if cfg.cache.regime == CacheRegime.GLOBAL and frames > rope_len:
            raise ConfigError(
                f"{cfg.num_blocks} blocks ({frames} latent frames) exceed the RoPE range of {rope_len} frames under "
                "the global cache. Use the recompute or noisy regime for long videos."
            )

    # ------------------------------------------------------------------ public API
    def run(self, prompt: str, *, on_block: Callable[[BlockEvent], None] | None = None, **kwargs) -> SDVGResult:
        gen = self.generate(prompt, **kwargs)
        while True:
            try:
                event = next(gen)
            except StopIteration as stop:
                return stop.value
            if on_block is not None:
                on_block(event)

    def generate(
        self,
        prompt: str,
        *,
        prompt_embeds: torch.Tensor | None = None,
        cancel: Callable[[], bool] | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
    ) -> Generator[BlockEvent, None, SDVGResult]:
        run = _Run(self, prompt, prompt_embeds, cancel, on_step)
        try:
            for block in range(self.config.num_blocks):
                yield run.block(block)
        except CancelledError:
            run.partial = True
            logger.info("cancelled after %d finished block(s)", len(run.records))
        finally:
            run.close()
        return run.result()


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, list | tuple) else (value,)


class _Run:
    """State of one generation, kept apart so one sampler can serve many prompts."""

    def __init__(self, sampler: SpeculativeSampler, prompt, prompt_embeds, cancel, on_step):
        self.s = sampler
        cfg, models = sampler.config, sampler.models
        if not isinstance(prompt, str):
            raise ConfigError("The prompt must be a string (the reward model scores frames against it).")
        self.prompt = prompt
        self.cancel = cancel
        self.user_on_step = on_step
        self.router = Router(sampler.router_config)
        self.partial = False
        self.records: list[BlockRecord] = []
        self.history = BlockHistory()
        self.started = time.perf_counter()
        self.latent_hw = (cfg.height // VAE_SCALE, cfg.width // VAE_SCALE)
        self.block_shape = (1, LATENT_CHANNELS, FRAMES_PER_BLOCK, *self.latent_hw)
        self.frames = torch.empty((pixel_frames_for_blocks(cfg.num_blocks), cfg.height, cfg.width, 3))
        self.frames_done = 0
        self.vae = models.vae
        self.vae.reset()
        self.aux_device = torch.device(getattr(self.vae, "device", "cpu"))
        embeds = self._encode_prompt(prompt_embeds)
        self.denoisers: dict[str, BlockDenoiser] = {}
        self.devices: dict[str, torch.device] = {}
        for name in ("target", "drafter"):
            model = getattr(models, name)
            if model is None:
                continue
            self.devices[name] = _device_of(model)
            den = BlockDenoiser(model, cfg.cache, name=name)
            if cfg.cache.regime == CacheRegime.RECOMPUTE and cfg.first_frame == "reencode":
                den.first_frame_hook = self._context_first_frame
            den.start(
                embeds.to(self.devices[name]),
                latent_shape=self.latent_hw,
                num_frames=cfg.num_blocks * FRAMES_PER_BLOCK,
            )
            self.denoisers[name] = den
        self.seen_forwards = {name: 0 for name in self.denoisers}
        self.call_stats = {name: {"seconds": 0.0, "calls": 0} for name in self.denoisers}
        # Krea's re-encoded first context frame runs inside a denoise (the first forward's context needs it): its
        # time is kept apart, so the per-forward means stay forward times
        self.call_stats["encode"] = {"seconds": 0.0, "calls": 0}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdvg-verify") if cfg.pipelined else None
        self.side_stream = (
            torch.cuda.Stream(self.aux_device) if cfg.pipelined and self.aux_device.type == "cuda" else None
        )
        self.next_draft: _Draft | None = None
        self.noise_block: int | None = None
        self.noise: dict = {}
        self.first_frame_cache: dict[tuple[int, int], torch.Tensor] = {}
        self.draft_decoded: tuple[int, threading.Event, list] | None = None  # pipelined: (block, ready, [frames])

    # ---------------------------------------------------------------- helpers
    def _encode_prompt(self, prompt_embeds):
        if prompt_embeds is not None:
            return prompt_embeds
        if self.s.models.text_encoder is None:
            raise ConfigError("No text encoder and no prompt embeddings were given.")
        return self.s.models.text_encoder.encode(self.prompt)

    def _step_hook(self, block: int, model: str):
        def hook(step: int, num_steps: int) -> None:
            if self.cancel is not None and self.cancel():
                raise CancelledError(f"cancelled at block {block}, {model} step {step}")
            if self.user_on_step is not None:
                self.user_on_step(StepEvent(block, model, step, num_steps))

        return hook

    def _denoise(self, model: str, block: int, history: BlockHistory, timings: dict, **kwargs) -> DenoiseResult:
        """Bring ``model``'s cache up to ``history`` (deferred work), then denoise ``block`` with the shared noise."""
        den, device = self.denoisers[model], self.devices[model]
        with _Timer.phase("cache", timings, device):
            den.sync(history)
        noise = self._block_noise(block, device, _dtype_of(getattr(self.s.models, model)))
        phase = "draft" if model == "drafter" else "target"
        before, start, encoding = den.forwards, time.perf_counter(), self.call_stats["encode"]["seconds"]
        with _Timer.phase(phase, timings, device):
            result = den.denoise(block, noise, self.s.schedule[block], on_step=self._step_hook(block, model), **kwargs)
        encoded = self.call_stats["encode"]["seconds"] - encoding
        self.call_stats[model]["seconds"] += time.perf_counter() - start - encoded
        self.call_stats[model]["calls"] += den.forwards - before
        return result

    def _block_noise(self, block: int, device: torch.device, dtype: torch.dtype):
        """The block's noise, sampled once per block and moved once per (device, dtype): the drafter and a
        rejecting target share exactly the same tensors."""
        if self.noise_block != block:
            self.noise_block, self.noise = block, {}
        key = (device, dtype)
        if key not in self.noise:
            self.noise[key] = sample_block_noise(
                self.s.config.seed, block, self.block_shape, len(self.s.schedule[block]), device=device, dtype=dtype
            )
        return self.noise[key]

    def _context_first_frame(self, history: BlockHistory) -> torch.Tensor:
        """Krea's first context frame for the block after ``history``: the oldest of the last 9 decoded pixel
        frames, VAE-encoded as a standalone image. Computed once per history and shared by both models."""
        n = len(history)
        key = (n, history.blocks[-1].token)
        if key in self.first_frame_cache:
            return self.first_frame_cache[key]
        index = pixel_frames_for_blocks(n) - 9  # 9 = 1 + (3 − 1)·4 pixel frames of the last 2 latents + 1
        if index < self.frames_done:
            frame = self.frames[index : index + 1]
        else:  # pipelined: the speculative last block is the draft being decoded on the worker right now
            block, ready, holder = self.draft_decoded
            if block != n - 1:
                raise ConfigError(f"Pixel frame {index} for block {n}'s context is not decoded yet.")
            ready.wait()
            if not holder:
                raise ConfigError("The speculative draft could not be decoded.")
            offset = index - pixel_frames_for_blocks(n - 1)  # position inside the draft's own frames
            frame = holder[0][offset : offset + 1]
        start = time.perf_counter()
        latent = self.vae.encode_frame(frame)
        stats = self.call_stats["encode"]
        stats["seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        if len(self.first_frame_cache) >= 4:  # the committed and the speculative history of two blocks
            self.first_frame_cache.pop(next(iter(self.first_frame_cache)))
        self.first_frame_cache[key] = latent
        return latent

    def _verify(self, draft: _Draft, timings: dict, decoded: tuple | None = None):
        """Snapshot the VAE, decode the draft and score it. Returns (snapshot, frames, scores)."""
        snapshot = self.vae.snapshot()
        try:
            with _Timer.phase("decode", timings, self.aux_device):
                frames = self.vae.decode_block(draft.result.x0)
            if decoded is not None:
                if self.side_stream is not None:
                    self.side_stream.synchronize()  # the drafter's thread reads these frames on its own stream
                decoded[2].append(frames)
        finally:
            if decoded is not None:
                decoded[1].set()  # never leave a waiting drafter hanging, even if the decode failed
        scores = None
        if self.router.needs_scores(draft.block):
            with _Timer.phase("score", timings, self.aux_device):
                if self.router.can_exit_early:
                    chunks = self.s.models.reward.score_chunks(frames, self.prompt, EARLY_EXIT_CHUNK)
                    scores = self.router.decide_streaming(draft.block, chunks)
                else:
                    scores = self.s.models.reward.score(frames, self.prompt)
        return snapshot, frames, scores

    def _verify_on_worker(self, draft: _Draft, ready: torch.cuda.Event | None, decoded: tuple):
        timings: dict[str, float] = {}
        if self.side_stream is None:
            return (*self._verify(draft, timings, decoded), timings)
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(ready)
            return (*self._verify(draft, timings, decoded), timings)

    def _draftable(self, block: int) -> bool:
        return block < self.s.config.num_blocks and self.router.forced_target(block) is None

    # ---------------------------------------------------------------- one block
    def block(self, b: int) -> BlockEvent:
        timings: dict[str, float] = {}
        forced = self.router.forced_target(b)
        if forced is not None:
            result = self._denoise("target", b, self.history, timings)
            return self._commit_target(b, result, None, forced, timings)
        draft, self.next_draft = self.next_draft, None
        if draft is None or draft.block != b:
            result = self._denoise("drafter", b, self.history, timings)
            draft = _Draft(b, result, _history_block(b, result))
        if self.executor is not None and self._draftable(b + 1):
            snapshot, frames, scores, next_draft = self._verify_while_drafting_next(draft, timings)
        else:
            (snapshot, frames, scores), next_draft = self._verify(draft, timings), None
        route = scores if isinstance(scores, RouteRecord) else self.router.decide(b, scores)
        if route.decision == "accept":
            self.history.append(draft.history_block)
            self.next_draft = next_draft
            return self._finish(b, frames, route, "drafter", True, timings)
        self.vae.restore(snapshot)
        result = self._regenerate(b, draft, timings)
        return self._commit_target(b, result, route, None, timings)

    def _verify_while_drafting_next(self, draft: _Draft, timings: dict):
        """Pipelined verification: decode and score block b on a worker while the drafter drafts b+1,
        assuming b is accepted. On reject the speculative draft is thrown away."""
        ready = None
        if self.side_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.devices["drafter"]))
        self.draft_decoded = (draft.block, threading.Event(), [])
        future = self.executor.submit(self._verify_on_worker, draft, ready, self.draft_decoded)
        speculative = self.history.extended(draft.history_block)
        try:
            result = self._denoise("drafter", draft.block + 1, speculative, timings)
            next_draft = _Draft(draft.block + 1, result, _history_block(draft.block + 1, result))
        finally:
            start = time.perf_counter()
            snapshot, frames, scores, worker_timings = future.result()
            timings["verify_wait"] = time.perf_counter() - start
        for key, value in worker_timings.items():
            timings[key] = timings.get(key, 0.0) + value
        return snapshot, frames, scores, next_draft

    def _regenerate(self, b: int, draft: _Draft, timings: dict) -> DenoiseResult:
        """The target redoes a rejected block from the same noise; refine-on-reject starts mid-way from the draft."""
        k = self.s.config.refine_from_step
        if k is not None and k < len(self.s.schedule[b]):
            x0 = draft.result.x0.to(self.devices["target"])
            return self._denoise("target", b, self.history, timings, start_step=k, x0_init=x0)
        return self._denoise("target", b, self.history, timings)

    def _commit_target(self, b, result: DenoiseResult, route, forced_reason, timings) -> BlockEvent:
        with _Timer.phase("decode", timings, self.aux_device):
            frames = self.vae.decode_block(result.x0)
        if route is None:
            scores = None
            if self.router.wants_reference_score(b):
                with _Timer.phase("score", timings, self.aux_device):
                    scores = self.s.models.reward.score(frames, self.prompt)
                self.router.observe_reference(b, scores)
            route = self.router.forced_record(b, forced_reason, scores)
        self.history.append(_history_block(b, result))
        return self._finish(b, frames, route, "target", forced_reason is None, timings)

    def _finish(self, b, frames, route: RouteRecord, produced_by, drafted, timings) -> BlockEvent:
        with _Timer.phase("output", timings):
            n = frames.shape[0]
            out = self.frames[self.frames_done : self.frames_done + n]
            out.copy_(frames)
            self.frames_done += n
        forwards = {}
        for name, den in self.denoisers.items():
            forwards[name] = den.forwards - self.seen_forwards[name]
            self.seen_forwards[name] = den.forwards
        record = BlockRecord(
            block=b,
            decision=route.decision,
            reason=route.reason,
            produced_by=produced_by,
            steps=len(self.s.schedule[b]),
            q=route.q,
            scores=list(route.scores),
            tau=route.tau,
            aggregation=route.aggregation,
            drafted=drafted,
            timings=timings,
            forwards=forwards,
        )
        self.records.append(record)
        return BlockEvent(b, out, record)

    # ---------------------------------------------------------------- end
    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        for den in self.denoisers.values():
            den.release()

    def result(self) -> SDVGResult:
        cfg = self.s.config
        frames = self.frames[: self.frames_done]
        if cfg.num_frames is not None and not self.partial:
            frames = frames[: cfg.num_frames]
        if cfg.output_dtype == "uint8":
            frames = (frames * 255.0).round_().clamp_(0, 255).to(torch.uint8)
        latents = self.history.latents() if len(self.history) else torch.empty(0)
        totals = _totals(self.records, time.perf_counter() - self.started, self.call_stats, self.s)
        return SDVGResult(frames, latents, self.records, self.partial, totals, self.settings())

    def settings(self) -> dict:
        cfg = self.s.config
        router = {k: _json_float(v) for k, v in asdict(self.s.router_config).items()}
        return {
            "prompt": self.prompt,
            "num_blocks": cfg.num_blocks,
            "width": cfg.width,
            "height": cfg.height,
            "seed": cfg.seed,
            "cache": cfg.cache.regime.value,
            "window_frames": cfg.cache.window_frames,
            "sink_frames": cfg.cache.sink_frames,
            "schedule": self.s.schedule,
            "pipelined": cfg.pipelined,
            "refine_from_step": cfg.refine_from_step,
            "router": router,
        }


def _json_float(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def _history_block(block: int, result: DenoiseResult) -> HistoryBlock:
    return HistoryBlock(
        index=block, x0=result.x0, last_noisy=result.last_noisy, last_t=result.last_t, token=result.token
    )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "compute_dtype", None)
    if dtype is not None:
        return dtype
    return next(model.parameters()).dtype


def _totals(records: list[BlockRecord], wall: float, call_stats: dict, sampler: SpeculativeSampler) -> dict:
    """Acceptance, wall time, and the target-only time estimated from this run's measured per-call times.

    Cost model: a target-only block costs (steps + cache forwards) × the mean target forward time + one decode,
    plus, in the recompute regime with the re-encoded first frame, one encode from block 2 on; cache forwards are
    1 for the global (clean pass) and recompute (refill, blocks ≥ 1) regimes, 0 for noisy.
    """
    drafted = [r for r in records if r.drafted]
    accepted = [r for r in drafted if r.decision == "accept"]
    phases: dict[str, float] = {}
    for r in records:
        for k, v in r.timings.items():
            phases[k] = phases.get(k, 0.0) + v
    decodes = len(records) + len(drafted) - len(accepted)
    est = None
    target = call_stats.get("target", {"calls": 0})
    encode = call_stats.get("encode", {"calls": 0})
    if target["calls"] and records:
        per_forward = target["seconds"] / target["calls"]
        per_decode = phases.get("decode", 0.0) / max(1, decodes)
        per_encode = encode["seconds"] / encode["calls"] if encode["calls"] else 0.0
        regime = sampler.config.cache.regime
        reencode = regime == CacheRegime.RECOMPUTE and sampler.config.first_frame == "reencode"
        est = 0.0
        for r in records:
            extra = 0 if regime == CacheRegime.NOISY or (regime == CacheRegime.RECOMPUTE and r.block == 0) else 1
            est += (r.steps + extra) * per_forward + per_decode + (per_encode if reencode and r.block >= 2 else 0.0)
    return {
        "blocks": len(records),
        "planned_blocks": sampler.config.num_blocks,
        "drafted": len(drafted),
        "accepted": len(accepted),
        "acceptance": (len(accepted) / len(drafted)) if drafted else None,
        "wall_s": wall,
        "phase_s": phases,
        "forward_s": {k: (v["seconds"] / v["calls"] if v["calls"] else None) for k, v in call_stats.items()},
        "est_target_only_s": est,
        "speedup_est": (est / wall) if est and wall > 0 else None,
    }
