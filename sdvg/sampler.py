"""The speculative block sampler (SDVG) with Diagonal-Distillation sampling options.

:meth:`_Run.block` is SPEC §1 for one block b:

1. block 0 (or a block the router forces) goes to the target; no draft is wasted on it;
2. otherwise the drafter denoises the block from its pre-sampled noise ``z_b``, ``ε_b,*``;
3. the VAE state is snapshotted and the draft is decoded;
4. its frames are scored and routed: accept → the draft's latents, pixels and VAE state are kept;
5. reject → the VAE state is restored and the target regenerates from the same ``z_b`` and ``ε_b,*``;
6. the winning latents become context for both models (each model's cache catches up when it next runs).

How a draft is verified (on this thread, or decoded and scored on a worker while the next block is drafted) is the
verifier strategy's business (``verify.py``); the cache-regime rules are the cache policy's (``regimes.py``);
timings and counts are the run meter's (``meter.py``); model calls are announced to observers (``hooks.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from .blocks import FRAMES_PER_BLOCK, LATENT_CHANNELS, SPATIAL_MULTIPLE, VAE_SCALE, pixel_frames_for_blocks
from .causal import BlockDenoiser
from .context_frames import ContextFrames
from .errors import CancelledError, ConfigError
from .history import BlockHistory, DenoiseResult, HistoryBlock
from .hooks import CallObserver, Hooks
from .jsonable import to_jsonable
from .meter import RunMeter
from .pipeline import SDVGModels
from .regimes import CacheConfig
from .results import BlockEvent, BlockRecord, FrameBuffer, SDVGResult, StepEvent
from .router import Router, RouterConfig, RouteRecord
from .scheduler import FlowMatchScheduler, NoiseBank, build_step_schedule
from .verify import Draft, last_token, make_verifier

logger = logging.getLogger(__name__)

EARLY_EXIT_CHUNK = 3  # frames scored per forward when the router may stop at the first frame below τ
OUTPUT_DTYPES = ("float", "uint8")

__all__ = ["SamplerConfig", "SpeculativeSampler", "BlockEvent", "BlockRecord", "SDVGResult", "StepEvent",
           "pixel_frames_for_blocks"]


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
    output_dtype: str = "float"  # "float" ([0,1] float32) or "uint8"

    def validate(self) -> SamplerConfig:
        """Every check that needs no model (run it before loading any); raises ConfigError. Returns self."""
        for name in ("width", "height", "num_blocks", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}.")
        w, h, m = self.width, self.height, SPATIAL_MULTIPLE
        if w <= 0 or h <= 0 or w % m or h % m:
            raise ConfigError(
                f"Width and height must be positive multiples of {m}, got {w}×{h}. "
                f"Try {max(m, round(w / m) * m)}×{max(m, round(h / m) * m)}."
            )
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {self.num_blocks}.")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}.")
        if self.num_frames is not None and not 1 <= self.num_frames <= pixel_frames_for_blocks(self.num_blocks):
            raise ConfigError(f"num_frames {self.num_frames} does not fit {self.num_blocks} blocks.")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise ConfigError(f"output_dtype must be 'float' or 'uint8', got {self.output_dtype!r}.")
        if not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {type(self.cache).__name__}.")
        if self.refine_from_step is not None and self.refine_from_step < 1:
            raise ConfigError("refine_from_step must be ≥ 1 (step 0 would be a full regeneration).")
        self.step_schedule()
        return self

    def step_schedule(self) -> list[list[float]]:
        return build_step_schedule(self.schedule, self.num_blocks, FlowMatchScheduler())

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // VAE_SCALE, self.width // VAE_SCALE


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
        # The router's target-rate correction and pattern need the block count; never mutate the caller's config.
        self.router_config = replace(router, num_blocks=config.num_blocks).validate()
        self.scheduler = FlowMatchScheduler()
        self.schedule = build_step_schedule(config.schedule, config.num_blocks, self.scheduler)
        self.policy = config.cache.policy()

    # ------------------------------------------------------------------ validation
    def check_inputs(self) -> None:
        self.config.validate()
        cfg, models, router = self.config, self.models, self.router_config
        mode = router.mode
        if mode != "draft-only" and models.target is None:
            raise ConfigError(f"Routing mode '{mode}' needs a target model; none was given.")
        if mode != "target-only" and models.drafter is None:
            raise ConfigError(f"Routing mode '{mode}' needs a drafter model; none was given.")
        if router.scores_drafts and models.reward is None:
            raise ConfigError(f"Routing mode '{mode}' scores drafts: it needs a reward model (ImageReward); none was given.")
        if cfg.pipelined and mode == "target-only":
            raise ConfigError("Pipelined verification needs a drafter; it does nothing in target-only mode.")
        if cfg.pipelined and torch.device(getattr(models.vae, "device", "cpu")).type != "cuda":
            logger.warning(
                "Pipelined verification overlaps decode+score with drafting well only when the VAE and reward run "
                "on a CUDA device; on the CPU the two threads share the cores and it is usually slower."
            )
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
        _, p_h, p_w = _as_tuple(model.config["patch_size"])
        h, w = cfg.latent_hw
        if max(h // p_h, w // p_w) > rope_len:
            raise ConfigError(f"{cfg.width}×{cfg.height} exceeds the model's RoPE range ({rope_len} tokens per axis).")
        cfg.cache.policy().check_length(cfg.num_blocks * FRAMES_PER_BLOCK, rope_len)

    # ------------------------------------------------------------------ public API
    def run(self, prompt: str, *, on_block: Callable[[BlockEvent], None] | None = None, **kwargs) -> SDVGResult:
        gen = self.generate(prompt, **kwargs)
        try:
            while True:
                try:
                    event = next(gen)
                except StopIteration as stop:
                    return stop.value
                if on_block is not None:
                    on_block(event)
        finally:
            gen.close()  # an error in on_block: the run still releases its worker thread and caches at once

    def generate(
        self,
        prompt: str,
        *,
        prompt_embeds: torch.Tensor | None = None,
        cancel: Callable[[], bool] | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
        observers: Sequence[CallObserver] = (),
    ) -> Generator[BlockEvent, None, SDVGResult]:
        """``cancel()`` is polled before every denoising step; ``on_step`` gets a :class:`StepEvent` per step;
        ``observers`` hear every model call of this run (see ``hooks.py``)."""
        run = _Run(self, prompt, prompt_embeds, cancel, on_step, observers)
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

    def __init__(self, sampler: SpeculativeSampler, prompt, prompt_embeds, cancel, on_step, observers):
        if not isinstance(prompt, str):
            raise ConfigError("The prompt must be a string (the reward model scores frames against it).")
        self.s, self.prompt, self.cancel, self.user_on_step = sampler, prompt, cancel, on_step
        cfg, models = sampler.config, sampler.models
        self.router = Router(sampler.router_config)
        self.partial = False
        self.records: list[BlockRecord] = []
        self.history = BlockHistory()
        self.vae, self.reward = models.vae, models.reward
        self.vae.reset()
        self.aux_device = torch.device(getattr(self.vae, "device", "cpu"))
        self.frames = FrameBuffer(pixel_frames_for_blocks(cfg.num_blocks), cfg.height, cfg.width)
        self.noise = NoiseBank(cfg.seed, (1, LATENT_CHANNELS, FRAMES_PER_BLOCK, *cfg.latent_hw), sampler.schedule)
        names = [name for name in ("target", "drafter") if getattr(models, name) is not None]
        self.meter = RunMeter(names)
        self.hooks = Hooks((self.meter, *observers))
        self.verifier = make_verifier(self, cfg.pipelined)
        self.denoisers = self._start_denoisers(names, self._encode_prompt(prompt_embeds))

    def _start_denoisers(self, names: list[str], embeds: torch.Tensor) -> dict[str, BlockDenoiser]:
        cfg, models = self.s.config, self.s.models
        context = ContextFrames(self.vae, self.frames, self.verifier.frames_in_flight, self.hooks)
        denoisers = {}
        for name in names:
            den = BlockDenoiser(getattr(models, name), cfg.cache, name=name, hooks=self.hooks)
            if den.policy.reencodes_first_frame:
                den.first_frame_hook = context
            den.start(embeds.to(den.device), latent_shape=cfg.latent_hw, num_frames=cfg.num_blocks * FRAMES_PER_BLOCK)
            denoisers[name] = den
        return denoisers

    def _encode_prompt(self, prompt_embeds):
        if prompt_embeds is not None:
            return prompt_embeds
        if self.s.models.text_encoder is None:
            raise ConfigError("No text encoder and no prompt embeddings were given.")
        return self.s.models.text_encoder.encode(self.prompt)

    @property
    def drafter_device(self) -> torch.device:
        return self.denoisers["drafter"].device

    # ---------------------------------------------------------------- one block: SPEC §1
    def block(self, b: int) -> BlockEvent:
        timings: dict[str, float] = {}
        forced = self.router.forced_target(b)
        if forced is not None:  # 1. block 0 anchors composition: the target makes it, no draft
            result = self._denoise("target", b, self.history, timings)
            return self._commit_target(b, result, None, forced, timings)
        draft = self.verifier.draft(b, timings)  # 2. the drafter denoises z_b with ε_b,*
        check = self.verifier.verify(draft, timings)  # 3. snapshot the VAE, decode; 4. score and route
        if check.route.accepted:  # 4. accept: the draft's latents, pixels and VAE state are the block
            self.history.append(draft.history_block)  # 6. ... and its latents the context
            return self._finish(b, check.frames, check.route, "drafter", True, timings)
        self.vae.restore(check.snapshot)  # 5. reject: back to the VAE state before the draft,
        result = self._regenerate(b, draft, timings)  # the target redoes the block from the same noise
        return self._commit_target(b, result, check.route, None, timings)  # 6. its latents become the context

    # ---------------------------------------------------------------- the steps' parts (VerifyHost for the verifier)
    def draftable(self, block: int) -> bool:
        return block < self.s.config.num_blocks and self.router.forced_target(block) is None

    def draft_on(self, block: int, history: BlockHistory, timings: dict) -> Draft:
        return Draft(block, self._denoise("drafter", block, history, timings), last_token(history))

    def decode(self, latents: torch.Tensor, timings: dict) -> torch.Tensor:
        with self.meter.phase(timings, "decode", self.aux_device):
            with self.hooks.call("decode", (self.vae.frames_decoded == 0, int(latents.shape[2]))):
                return self.vae.decode_block(latents)

    def score(self, frames: torch.Tensor, timings: dict) -> torch.Tensor:
        with self.meter.phase(timings, "score", self.aux_device), self.hooks.call("score", (int(frames.shape[0]),)):
            return self.reward.score(frames, self.prompt)

    def route(self, block: int, frames: torch.Tensor, timings: dict) -> RouteRecord:
        """Score the draft's frames when the router wants scores, and decide."""
        router = self.router
        if not router.needs_scores(block):
            return router.decide(block)
        if not router.can_exit_early:
            return router.decide(block, self.score(frames, timings))
        with self.meter.phase(timings, "score", self.aux_device), self.hooks.call("score", (int(frames.shape[0]),)):
            return router.decide_streaming(block, self.reward.score_chunks(frames, self.prompt, EARLY_EXIT_CHUNK))

    def _step_hook(self, block: int, model: str):
        def hook(step: int, num_steps: int) -> None:
            if self.cancel is not None and self.cancel():
                raise CancelledError(f"cancelled at block {block}, {model} step {step}")
            if self.user_on_step is not None:
                self.user_on_step(StepEvent(block, model, step, num_steps))

        return hook

    def _denoise(self, model: str, block: int, history: BlockHistory, timings: dict, **kwargs) -> DenoiseResult:
        """Bring ``model``'s cache up to ``history`` (deferred work), then denoise ``block`` with the shared noise."""
        den = self.denoisers[model]
        with self.meter.phase(timings, "cache", den.device):
            den.sync(history)
        noise = self.noise.get(block, den.device, den.dtype)
        with self.meter.denoise(model, timings, den.device):
            return den.denoise(block, noise, self.s.schedule[block], on_step=self._step_hook(block, model), **kwargs)

    def _regenerate(self, b: int, draft: Draft, timings: dict) -> DenoiseResult:
        """The target redoes a rejected block from the same noise; refine-on-reject starts mid-way from the draft."""
        k = self.s.config.refine_from_step
        if k is not None and k < len(self.s.schedule[b]):
            x0 = draft.result.x0.to(self.denoisers["target"].device)
            return self._denoise("target", b, self.history, timings, start_step=k, x0_init=x0)
        return self._denoise("target", b, self.history, timings)

    def _commit_target(self, b, result: DenoiseResult, route, forced_reason, timings) -> BlockEvent:
        frames = self.decode(result.x0, timings)
        if route is None:
            scores = None
            if self.router.wants_reference_score(b):
                scores = self.score(frames, timings)
                self.router.observe_reference(b, scores)
            route = self.router.forced_record(b, forced_reason, scores)
        self.history.append(HistoryBlock.of(b, result))
        return self._finish(b, frames, route, "target", forced_reason is None, timings)

    def _finish(self, b, frames, route: RouteRecord, produced_by, drafted, timings) -> BlockEvent:
        with self.meter.phase(timings, "output"):
            out = self.frames.append(frames)
        record = BlockRecord(
            block=b, decision=route.decision, reason=route.reason, produced_by=produced_by,
            steps=len(self.s.schedule[b]), q=route.q, scores=list(route.scores), tau=route.tau,
            aggregation=route.aggregation, drafted=drafted, timings=timings, forwards=self.meter.block_forwards(),
        )
        self.records.append(record)
        return BlockEvent(b, out, record)

    # ---------------------------------------------------------------- end
    def close(self) -> None:
        self.verifier.close()
        for den in self.denoisers.values():
            den.release()

    def result(self) -> SDVGResult:
        cfg = self.s.config
        frames = self.frames.finished()
        if cfg.num_frames is not None and not self.partial:
            frames = frames[: cfg.num_frames]
        if cfg.output_dtype == "uint8":
            frames = (frames * 255.0).round_().clamp_(0, 255).to(torch.uint8)
        latents = self.history.latents() if len(self.history) else torch.empty(0)
        totals = self.meter.totals(self.records, self.s.policy, cfg.num_blocks)
        return SDVGResult(frames, latents, self.records, self.partial, totals, self.settings())

    def settings(self) -> dict:
        cfg = self.s.config
        return {
            "prompt": self.prompt,
            "num_blocks": cfg.num_blocks,
            "width": cfg.width,
            "height": cfg.height,
            "seed": cfg.seed,
            "cache": cfg.cache.regime.value,
            "window_frames": cfg.cache.window_frames,
            "sink_frames": cfg.cache.sink_frames,
            "first_frame": cfg.cache.first_frame,
            "schedule": self.s.schedule,
            "pipelined": cfg.pipelined,
            "refine_from_step": cfg.refine_from_step,
            "router": to_jsonable(asdict(self.s.router_config)),
        }
