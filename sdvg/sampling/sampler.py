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
from dataclasses import replace

import torch

from ..blocks import FRAMES_PER_BLOCK, LATENT_CHANNELS, pixel_frames_for_blocks
from ..errors import CancelledError, ConfigError, NonFiniteError, RunFailed
from ..loaders.bundle import SDVGModels
from ..models.dit import check_dit_pair
from .calls import CallObserver, Hooks
from .causal import BlockDenoiser
from .conditioning_frames import InitBlocks, VideoToVideo
from .config import SamplerConfig
from .context_frames import ContextFrames
from .history import BlockHistory, DenoiseResult, HistoryBlock
from .meter import RunMeter
from .prompt_schedule import PromptSchedule, check_prompt
from .results import BlockEvent, BlockRecord, SDVGResult, StepEvent
from .retention import drop_old_history, footprint, output_store
from .router import Router, RouterConfig, RouteRecord, runs_model
from .scheduler import FlowMatchScheduler, NoiseBank
from .stages import Decoding, Denoising, Scoring
from .verify import make_verifier

logger = logging.getLogger(__name__)

__all__ = ["SamplerConfig", "SpeculativeSampler", "BlockEvent", "BlockRecord", "SDVGResult", "StepEvent",
           "pixel_frames_for_blocks"]


class SpeculativeSampler:
    """Generates a video block by block with a drafter, a target and a reward router.

    ``generate`` is a generator: it yields a :class:`BlockEvent` per finished block and returns the
    :class:`SDVGResult` (``StopIteration.value``); ``run`` consumes it for you.
    """

    def __init__(self, models: SDVGModels, router: RouterConfig, config: SamplerConfig, *,
                 pooled_scores: list[float] | None = None):
        self.models = models
        self.config = config
        self.router_config = router
        self.check_inputs()
        # The router's target-rate correction and pattern need the block count; never mutate the caller's config.
        self.router_config = replace(router, num_blocks=config.num_blocks).validate()
        self.scheduler = FlowMatchScheduler()
        self.schedules = {"target": config.step_schedule(), "drafter": config.step_schedule("drafter")}
        self.schedule = self.schedules["target"]
        self.policy = config.cache.policy()
        # threshold_state "pooled": the target-rate statistics of every run of this sampler (or of a caller's pool)
        self.pooled_scores: list[float] = [] if pooled_scores is None else pooled_scores

    # ------------------------------------------------------------------ validation
    def check_inputs(self) -> None:
        self.config.validate()
        self._check_model_types()
        cfg, models, router = self.config, self.models, self.router_config
        mode = router.mode
        for role in ("target", "drafter"):
            if runs_model(mode, role) and getattr(models, role) is None:
                raise ConfigError(f"Routing mode '{mode}' needs a {role} model; none was given.")
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
            cfg.check_dit_fits(m.config)
        if len(dits) == 2:
            check_dit_pair(models.target.config, models.drafter.config)

    def _check_model_types(self) -> None:
        """Each model is what its role needs (a wrong object is named, not a raw AttributeError later)."""
        models = self.models
        wants = {"target": ("forward_block", "config"), "drafter": ("forward_block", "config"),
                 "vae": ("decode_block", "snapshot", "restore", "encode_frame"), "reward": ("score",),
                 "text_encoder": ("encode",)}
        loaders = {"target": "load_dit", "drafter": "load_dit", "vae": "open_vae",
                   "reward": "load_image_reward", "text_encoder": "load_text_encoder"}
        for role, needed in wants.items():
            model = getattr(models, role, None)
            if model is not None and not all(hasattr(model, a) for a in needed):
                raise ConfigError(f"models.{role} is a {type(model).__name__}, not what the {role} needs: load it with "
                                  f"{loaders[role]}.")
        if models.vae is None:
            raise ConfigError("models.vae is missing: every run decodes its blocks (open_vae).")
        width = getattr(models.text_encoder, "text_dim", None)
        for role in ("target", "drafter"):
            dit = getattr(models, role)
            if width is not None and dit is not None and int(dit.config["text_dim"]) != int(width):
                raise ConfigError(
                    f"The text encoder is {width} wide but the {role} reads {dit.config['text_dim']}-wide prompt "
                    "embeddings: use the UMT5 encoder that belongs to these DiTs (UMT5-XXL, 4096, for Wan 2.1)."
                )

    # ------------------------------------------------------------------ public API
    def run(self, prompt: str | PromptSchedule, *, on_block: Callable[[BlockEvent], None] | None = None,
            **kwargs) -> SDVGResult:
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
        prompt: str | PromptSchedule,
        *,
        prompt_embeds: torch.Tensor | Sequence[torch.Tensor] | None = None,
        cancel: Callable[[], bool] | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
        observers: Sequence[CallObserver] = (),
        video: VideoToVideo | None = None,
        init: InitBlocks | None = None,
    ) -> Generator[BlockEvent, None, SDVGResult]:
        """``prompt`` is one prompt or a :class:`PromptSchedule` (then ``prompt_embeds``, if given, is one tensor per
        scheduled prompt). ``cancel()`` is polled before every denoising step; ``on_step`` gets a :class:`StepEvent`
        per step; ``observers`` hear every model call of this run (see ``hooks.py``); ``video``: video-to-video,
        ``init``: given first blocks (``conditioning_frames.py``)."""
        run = _Run(self, prompt, prompt_embeds, cancel, on_step, observers, video, init)
        fault = None
        try:
            first = init.num_blocks if init is not None else 0
            for block in range(first):
                yield run.given_block(block, init.block(block))
            for block in range(first, self.config.num_blocks):
                yield run.block(block)
        except CancelledError:
            run.partial = True
            logger.info("cancelled after %d finished block(s)", len(run.records))
        except Exception as exc:  # a fault in one block: every finished block is kept in the result
            if getattr(exc, "sdvg_from_callback", False):
                raise
            run.partial, fault = True, exc
        finally:
            run.close()
        result = run.result()
        if fault is not None:
            raise RunFailed(describe_fault(fault, len(run.records)), result) from fault
        return result


STAGE_NAMES = {"draft": "the drafter", "target": "the target", "decode": "the VAE decoder",
               "score": "the reward model (ImageReward)", "cache": "a DiT's cache update", "output": "the output copy"}


def describe_fault(exc: BaseException, finished: int) -> str:
    """What failed (the block, the stage and the model), why, and that the finished blocks were kept."""
    stage = STAGE_NAMES.get(getattr(exc, "sdvg_stage", ""), "the sampler")
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not isinstance(exc, NonFiniteError | ConfigError):
        detail = f"{type(exc).__name__}: {detail}"
    hint = ""
    if "out of memory" in detail.lower():
        hint = (" Free memory: fewer blocks or a smaller size, fp8 weights for the DiTs, or the text encoder, VAE and "
                "reward on another device (--aux-device / the loaders' device).")
    kept = f"the {finished} finished block(s) were kept" if finished else "no block had finished"
    return f"Block {finished} failed in {stage}: {detail}{hint} ({kept})."


def _check_given_frames(cfg: SamplerConfig, video: VideoToVideo | None, init: InitBlocks | None) -> None:
    if init is not None:
        init.check_fits(cfg.num_blocks, cfg.latent_hw)
    if video is not None:
        video.check_fits(cfg.num_blocks, cfg.latent_hw)
        if cfg.refine_from_step is not None:
            raise ConfigError("refine_from_step and video-to-video both choose where a block starts; use one.")


class _Run:
    """State of one generation, kept apart so one sampler can serve many prompts."""

    def __init__(self, sampler: SpeculativeSampler, prompt, prompt_embeds, cancel, on_step, observers, video=None,
                 init=None):
        self.prompts = prompt if isinstance(prompt, PromptSchedule) else None  # a prompt timeline
        if self.prompts is not None:
            self.prompts.check_blocks(sampler.config.num_blocks)
            prompt = self.prompts.prompt_at(0)
        if not isinstance(prompt, str):
            raise ConfigError("The prompt must be a string (the reward model scores frames against it).")
        check_prompt(prompt, "The prompt")  # an empty one is refused in the API too, not only in the CLI and nodes
        self.s, self.prompt = sampler, prompt
        cfg, models = sampler.config, sampler.models
        compat = self.compat = cfg.compat
        self.video, self.init = video, init
        _check_given_frames(cfg, video, init)
        pooled = sampler.pooled_scores if compat.threshold_state == "pooled" else None
        # a prompt switch under a relative threshold: the target makes the block and sets the new reference
        anchors = frozenset(self.prompts.switches) if self.prompts is not None else frozenset()
        self.router = Router(sampler.router_config, shared_history=pooled, anchors=anchors)
        self.partial = False
        self.records: list[BlockRecord] = []
        self.history = BlockHistory()
        self.vae, self.reward = models.vae, models.reward
        self.vae.reset(decoder=compat.vae_decoder)
        self.frames = output_store(cfg)  # all frames, or (long videos: flat memory) the last blocks'
        longest = [max(a, b, key=len) for a, b in zip(*sampler.schedules.values(), strict=True)]  # ε shared by prefix
        self.noise = NoiseBank(cfg.seed, (1, LATENT_CHANNELS, FRAMES_PER_BLOCK, *cfg.latent_hw), longest)
        names = [name for name in ("target", "drafter") if getattr(models, name) is not None]
        self.meter = RunMeter(names)
        self.hooks = Hooks((self.meter, *observers))
        self._compose_stages(cancel, on_step)
        self.denoisers = self.denoising.denoisers
        self.denoisers.update(self._start_denoisers(names, self._encode_prompt(prompt_embeds)))
        self.running = [self.denoisers[n] for n in names if runs_model(self.router.config.mode, n)]

    def _compose_stages(self, cancel, on_step) -> None:
        """The model stages and the verifier, each handed its collaborators (none calls back into the run)."""
        cfg = self.s.config
        self.decoding = Decoding(self.vae, self.meter, self.hooks)
        self.scoring = None if self.reward is None else Scoring(self.reward, self.meter, self.hooks,
                                                                self.decoding.device, self.prompt_at,
                                                                self.compat.reward_preprocess)
        self.denoising = Denoising(cfg, self.s.schedules, self.noise, self.meter, video=self.video, cancel=cancel,
                                   on_step=on_step)
        self.verifier = make_verifier(cfg.pipelined, self.denoising, self.decoding, self.scoring, self.router,
                                      self.history, cfg.num_blocks)

    def _start_denoisers(self, names: list[str], embeds: torch.Tensor) -> dict[str, BlockDenoiser]:
        cfg, models = self.s.config, self.s.models
        context = ContextFrames(self.vae, self.frames, self.verifier.frames_in_flight, self.hooks)
        denoisers = {}
        for name in names:
            den = BlockDenoiser(getattr(models, name), cfg.cache, name=name, hooks=self.hooks)
            den.prompts = self.prompts
            if den.policy.reencodes_first_frame:
                den.first_frame_hook = context
            den.start(embeds.to(den.device), latent_shape=cfg.latent_hw, num_frames=cfg.num_blocks * FRAMES_PER_BLOCK)
            denoisers[name] = den
        return denoisers

    def _encode_prompt(self, prompt_embeds):
        """Block 0's embeddings (every scheduled prompt is embedded once, up front)."""
        if self.prompts is not None:
            self.prompts.encode(self._embed, prompt_embeds)
            for e in self.prompts.embeddings:
                self._check_embeds(e)
            return self.prompts.embeds_for(self.prompts.conditioning_key(0))
        return self._check_embeds(self._embed(self.prompt) if prompt_embeds is None else prompt_embeds)

    def _embed(self, prompt: str) -> torch.Tensor:
        if self.s.models.text_encoder is None:
            raise ConfigError("No text encoder and no prompt embeddings were given.")
        return self.s.models.text_encoder.encode(prompt)

    def _check_embeds(self, prompt_embeds):
        dit = self.s.models.target if self.s.models.target is not None else self.s.models.drafter
        want = int(dit.config["text_dim"])
        if not torch.is_tensor(prompt_embeds) or prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != 1 \
                or prompt_embeds.shape[-1] != want or not prompt_embeds.is_floating_point():
            got = tuple(prompt_embeds.shape) if torch.is_tensor(prompt_embeds) else type(prompt_embeds).__name__
            raise ConfigError(f"prompt_embeds must be a float tensor [1, tokens, {want}] (the DiTs' text width); "
                              f"got {got}.")
        return prompt_embeds

    def prompt_at(self, block: int) -> str:
        """The prompt ``block`` is scored against."""
        return self.prompt if self.prompts is None else self.prompts.prompt_at(block)

    # ---------------------------------------------------------------- one block: SPEC §1
    def block(self, b: int) -> BlockEvent:
        timings: dict[str, float] = {}
        forced = self.router.forced_target(b)
        if forced is not None:  # 1. block 0 anchors composition: the target makes it, no draft
            result = self.denoising.denoise("target", b, self.history, timings)
            return self._commit_target(b, result, None, forced, timings)
        draft = self.verifier.draft(b, timings)  # 2. the drafter denoises z_b with ε_b,*
        check = self.verifier.verify(draft, timings)  # 3. snapshot the VAE, decode; 4. score and route
        if check.route.accepted:  # 4. accept: the draft's latents, pixels and VAE state are the block
            self.history.append(draft.history_block)  # 6. ... and its latents the context
            return self._finish(b, check.frames, check.route, "drafter", True, timings)
        self.decoding.restore(check.snapshot)  # 5. reject: back to the VAE state before the draft,
        result = self.denoising.regenerate(b, draft, self.history, timings)  # the target redoes it, same noise
        return self._commit_target(b, result, check.route, None, timings)  # 6. its latents become the context

    def given_block(self, b: int, latents: torch.Tensor) -> BlockEvent:
        """A block given as input (image-to-video, extension): committed as it is, decoded, never drafted or scored."""
        timings: dict[str, float] = {}
        frames = self.decoding.decode(latents, timings)
        self.history.append(HistoryBlock.of(b, DenoiseResult(x0=latents, last_noisy=latents, last_t=0.0, forwards=0)))
        return self._finish(b, frames, RouteRecord(b, "input", "given frames"), "input", False, timings)

    def _commit_target(self, b, result: DenoiseResult, route, forced_reason, timings) -> BlockEvent:
        frames = self.decoding.decode(result.x0, timings)
        if route is None:
            scores = None
            if self.router.wants_reference_score(b):
                scores = self.scoring.score(b, frames, timings)
                self.router.observe_reference(b, scores)
            route = self.router.forced_record(b, forced_reason, scores)
        self.history.append(HistoryBlock.of(b, result))
        return self._finish(b, frames, route, "target", forced_reason is None, timings)

    def _finish(self, b, frames, route: RouteRecord, produced_by, drafted, timings) -> BlockEvent:
        with self.meter.phase(timings, "output"):
            out = self.frames.append(frames)
        if not self.s.config.keep_output:
            drop_old_history(self.history, self.running, self.meter, timings)
        row = self.s.schedules.get(produced_by, self.s.schedule)[b]
        steps = len(row) - (self.video.start_step(row) if self.video else 0)
        record = BlockRecord(
            block=b, decision=route.decision, reason=route.reason, produced_by=produced_by,
            steps=steps if produced_by != "input" else 0, q=route.q, scores=list(route.scores), tau=route.tau,
            aggregation=route.aggregation, drafted=drafted, timings=timings, forwards=self.meter.block_forwards(),
            prompt=self.prompt_at(b) if self.prompts is not None and b in self.prompts.switches else None,
        )
        self.records.append(record)
        if b == 0 and self.compat.dropped_frames:  # the reference shows 6 frames of block 0 (all 9 stay context)
            out = out[self.compat.dropped_frames:]
        return BlockEvent(b, out, record, footprint(self.denoisers, self.history, self.frames, self.vae))

    # ---------------------------------------------------------------- end
    def close(self) -> None:
        self.verifier.close()
        for den in self.denoisers.values():
            den.release()

    def result(self) -> SDVGResult:
        cfg = self.s.config
        frames = self.frames.finished()[cfg.compat.dropped_frames:]
        if cfg.num_frames is not None and not self.partial:
            frames = frames[: cfg.num_frames]
        if cfg.output_dtype == "uint8":
            frames = (frames * 255.0).round_().clamp_(0, 255).to(torch.uint8)
        latents = self.history.latents() if len(self.history) and self.history.complete else torch.empty(0)
        target_steps = [len(row) for row in self.s.schedule]  # what a target-only run would take
        totals = self.meter.totals(self.records, self.s.policy, cfg.num_blocks, target_steps)
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
            "positions": cfg.cache.positions,
            "keep_output": cfg.keep_output,
            "schedule": self.s.schedule, "drafter_schedule": self.s.schedules["drafter"],
            "step_noise": cfg.step_noise, "drafter_step_noise": cfg.step_noise_for("drafter"),
            "pipelined": cfg.pipelined,
            "refine_from_step": cfg.refine_from_step,
            "stitch": cfg.stitch,
            "compat": cfg.compat.to_dict(),
            "router": self.s.router_config.to_dict(),
            "prompt_schedule": self.prompts.to_dict() if self.prompts is not None else None,
            "v2v_strength": self.video.strength if self.video is not None else None,
            "init_blocks": self.init.num_blocks if self.init is not None else 0,
        }
