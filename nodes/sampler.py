"""SDVGSpeculativeSampler: runs the engine's SpeculativeSampler and streams each block to the canvas.

A thin adapter: widget values become the engine's ``SamplerConfig`` (checked at queue time by ``validate_inputs``,
before any model loads), the run streams through a ``BlockStream`` (progress, one preview and one ``sdvg.block``
event per block), and the result becomes IMAGE, LATENT and the report. Cancel is polled before every model call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from contextlib import ExitStack, contextmanager

import torch
from comfy_api.latest import io

from ..sdvg import ConfigError, to_jsonable
from ..sdvg.sampling import (
    DEFAULT_PROFILE,
    POSITIONS,
    PROFILES,
    REGIMES,
    STEP_NOISES,
    CacheConfig,
    SamplerConfig,
    runs_model,
)
from ..sdvg.sampling import SCHEDULES as NAMED_SCHEDULES
from . import _host, _models
from .handles import DiTHandle
from .stream import BlockStream
from .types import SDVG_CONDITIONING, SDVG_DIT, SDVG_REWARD, SDVG_ROUTER, SDVG_START, SDVG_VAE

logger = logging.getLogger(__name__)

CACHE_REGIMES = list(REGIMES)
SCHEDULES = [*NAMED_SCHEDULES, "custom"]
# 1000 blocks = 11 997 frames ≈ 12.5 min at 16 fps; memory is flat in the length except for the IMAGE batch the
# node returns (float32: 832×480 is 4.8 MB a frame), which is refused beyond the machine's RAM and warned about here
MAX_BLOCKS = 1000
IMAGE_WARN_BYTES = 4 * 2**30
ON_CANCEL = ["stop", "keep finished blocks"]
# every widget default is the engine's field default (refine_from_step: 0 is the widget's "off", the engine's None)
_S, _C = SamplerConfig, CacheConfig
# a fault (NaN, out of memory, a model error) in block b: output blocks 0..b-1 with the error on the node, or fail the
# prompt (execution_error) as ComfyUI does for any node error; a fault in block 0 leaves nothing to keep and fails
ON_FAULT = ["keep finished blocks", "stop"]
# the drafter's own sampling (a distilled few-step drafter beside a flow-matching target, e.g. the toy world's
# Diagonal Distillation student); "same as target" is the engine's None
SAME = "same as target"
DRAFTER_SCHEDULES = [SAME, *NAMED_SCHEDULES]
DRAFTER_STEP_NOISES = [SAME, *STEP_NOISES]


def sampler_config(*, seed: int, blocks: int, width: int, height: int, cache: str, schedule: str,
                   custom_schedule: str, pipelined: bool = _S.pipelined, refine_from_step: int = 0,
                   profile: str = DEFAULT_PROFILE, positions: str = _C.positions, step_noise: str = _S.step_noise,
                   drafter_schedule: str = SAME, drafter_step_noise: str = SAME):
    """Widget values → a validated engine ``SamplerConfig`` (ConfigError names the problem and the fix)."""
    from ..sdvg.sampling import profile as compat_profile

    if schedule not in SCHEDULES:
        raise ConfigError(f"Unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
    spec = custom_schedule.strip() if schedule == "custom" else schedule
    if not spec:
        raise ConfigError("schedule is 'custom' but custom_schedule is empty; type e.g. 1000,750,500,250.")
    if not 1 <= int(blocks) <= MAX_BLOCKS:
        raise ConfigError(f"blocks must be between 1 and {MAX_BLOCKS}, got {blocks}.")
    return SamplerConfig(
        num_blocks=int(blocks), width=int(width), height=int(height), seed=int(seed),
        cache=CacheConfig(cache, positions=positions if cache == "noisy" else _C.positions),
        schedule=spec, pipelined=bool(pipelined), refine_from_step=int(refine_from_step) or None,
        compat=compat_profile(profile), step_noise=step_noise,
        drafter_schedule=None if drafter_schedule == SAME else drafter_schedule,
        drafter_step_noise=None if drafter_step_noise == SAME else drafter_step_noise,
    ).validate()


def _display_id(hidden, node_id: str) -> str:
    dynprompt = getattr(hidden, "dynprompt", None) if hidden is not None else None
    if dynprompt is not None and hasattr(dynprompt, "get_display_node_id"):
        try:
            return str(dynprompt.get_display_node_id(node_id))
        except Exception:
            logger.debug("display id lookup failed", exc_info=True)
    return node_id


def _bring_models(config, router, models, handles) -> None:
    """Ask ComfyUI to put every model of this run on its device, with room for what the run allocates there."""
    from ..sdvg.sampling import run_memory

    needs = run_memory(models, cache=config.cache, num_blocks=config.num_blocks, width=config.width,
                       height=config.height, mode=router.mode)
    _models.use([h.loaded() if isinstance(h, DiTHandle) else getattr(h, "managed", None) for h in handles], needs)


def _model_for(handle: DiTHandle | None, needed: bool):
    return handle.model if handle is not None and needed else None


@contextmanager
def _parked_after(handles):
    """The loader's ``offload_to_cpu_when_idle``: those DiTs leave the device after the run (also after an error)."""
    try:
        yield
    finally:
        for h in handles:
            if h is not None and h.offload == "offload_to_cpu_when_idle":
                _models.park(h.loaded())


class SDVGSpeculativeSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGSpeculativeSampler",
            display_name="SDVG Speculative Sampler",
            category="SDVG/sampling",
            description=(
                "Generates a video block by block (3 latent frames each): the drafter proposes a block, ImageReward "
                "scores its frames, the router keeps it or the target regenerates it from the same noise. Streams every "
                "block to the canvas as it finishes."
            ),
            inputs=[
                SDVG_DIT.Input("drafter", optional=True, tooltip="The small DiT that proposes blocks (Self-Forcing 1.3B). Not needed in target-only mode."),
                SDVG_DIT.Input("target", optional=True, tooltip="The large DiT that regenerates rejected blocks and block 0 (Krea Realtime 14B). Not needed in draft-only mode without force_reject_first."),
                SDVG_VAE.Input("vae", tooltip="Streaming Wan 2.1 VAE (SDVG Load Wan VAE)."),
                SDVG_CONDITIONING.Input("conditioning", tooltip="Prompt embeddings and text from SDVG Text Encode, or a prompt timeline from SDVG Prompt Schedule."),
                SDVG_ROUTER.Input("router", tooltip="The acceptance rule (SDVG Reward Router)."),
                SDVG_START.Input("start", optional=True, tooltip="Frames to start from (SDVG Start Frames): given first blocks (image-to-video, extension) or video-to-video."),
                SDVG_REWARD.Input("reward", optional=True, tooltip="ImageReward scorer. Needed in routing mode 'reward' (and for threshold modes that score the target)."),
                io.Int.Input("seed", default=_S.seed, min=0, max=0xFFFFFFFFFFFFFFF, control_after_generate=True, tooltip="Noise seed. Each block's noise depends only on (seed, block), never on routing."),
                io.Int.Input("blocks", default=_S.num_blocks, min=1, max=MAX_BLOCKS, tooltip="Number of 3-latent-frame blocks. Pixel frames = 12 × blocks − 3 (7 blocks = 81 frames ≈ 5 s at 16 fps). Long videos: use the recompute cache, or noisy with positions = window; the global cache is limited by the model's RoPE table (341 blocks). The IMAGE output holds every frame in RAM (a warning above 4 GiB); the CLI streams to disk instead."),
                io.Int.Input("width", default=_S.width, min=16, max=2048, step=16, tooltip="Frame width in pixels, a multiple of 16 (both models were trained at 832×480)."),
                io.Int.Input("height", default=_S.height, min=16, max=2048, step=16, tooltip="Frame height in pixels, a multiple of 16."),
                io.Combo.Input(
                    "cache",
                    options=CACHE_REGIMES,
                    default=_C.regime.value,
                    tooltip="KV-cache regime. recompute: Krea/SDVG windowed recompute (reference). global: Self-Forcing cache with a clean pass per block. noisy: Diagonal forcing, no clean pass, rolling window with sink frames.",
                ),
                io.Combo.Input(
                    "schedule",
                    options=SCHEDULES,
                    default=_S.schedule,
                    tooltip="Denoising steps per block. constant: 4 warped Self-Forcing steps for every block. diagonal: Diagonal Distillation, more steps early, fewer later. custom: the list typed below.",
                ),
                io.String.Input(
                    "custom_schedule",
                    default="1000,750,500,250",
                    tooltip="Used when schedule = custom: one comma list of timesteps (0 < t ≤ 1000, decreasing; warped to the shifted table) for all blocks, or a JSON list of lists per block (the last repeats).",
                ),
                io.Boolean.Input("pipelined", default=_S.pipelined, tooltip="Overlap verification (decode + score of block b) with drafting block b+1 on a second thread. Faster on two GPUs; a rejected block discards the early draft."),
                io.Int.Input("refine_from_step", default=0, min=0, max=16, tooltip="0 = a rejected block is regenerated by the target from scratch (paper). k ≥ 1 = the target starts at step k from the re-noised draft (cheaper, experimental)."),
                io.Combo.Input("positions", options=list(POSITIONS), default=_C.positions, tooltip="RoPE positions of the noisy cache. absolute: every frame at its frame index (as trained; at most the model's 1024-position table, 341 blocks). window: at its slot in the rolling window, so any length fits (the cache stores un-roped keys and ropes them on read). The recompute cache is always window-relative, the global one always absolute."),
                io.Combo.Input("on_cancel", options=ON_CANCEL, default="stop", tooltip="What Cancel does. stop: ComfyUI's usual interrupt, the prompt ends and nothing downstream runs. keep finished blocks: the sampler stops after the current step and outputs the blocks it finished (the report says partial), so a SaveVideo after it still saves them."),
                io.Combo.Input("profile", options=list(PROFILES), default=DEFAULT_PROFILE, tooltip="sdvg: our defaults. reference: the SDVG authors' exact behaviour (Krea's 5-step schedule with the t = 0 tail step, Krea's streaming VAE decoder, block 0 shown as 6 frames, target-rate statistics pooled across videos (one node run is one video, so here that changes nothing), ImageReward on uint8 PIL frames) to reproduce their numbers; see docs/REFERENCE.md. Which weights of a .pt load is the loader's business."),
                io.Combo.Input("step_noise", options=list(STEP_NOISES), default=_S.step_noise, tooltip="Between denoising steps the block is re-noised. fresh: with the block's own fresh noise (Self-Forcing, Krea: distilled few-step models; the paper). predicted: with the noise the model predicts, i.e. Euler steps of the flow ODE, for flow-matching models that were not distilled, such as the toy world's (with fresh noise their predictions stay a blurry average)."),
                io.Combo.Input("on_fault", options=ON_FAULT, default=ON_FAULT[0], optional=True, tooltip="What a fault in the middle of a run does (a model producing NaN, out of memory, a model error in block b). keep finished blocks: the sampler outputs blocks 0…b−1 (the report says partial and names the fault), the error is shown on this node, and the graph goes on, so a SaveVideo after it saves them. stop: the prompt fails with the error (ComfyUI's execution_error) and nothing downstream runs. A fault in block 0 always fails: there is nothing to keep."),
                io.Combo.Input("drafter_schedule", options=DRAFTER_SCHEDULES, default=SAME, optional=True, tooltip="The drafter's own denoising steps per block, for a distilled few-step drafter beside a target that samples otherwise (the toy world's Diagonal Distillation student: diagonal, 4→3→2 steps, with step noise fresh; the target keeps its schedule). diagonal-1: 4 steps for block 0, then one step a block (the cheapest drafts; block 0 is the target's in SDVG). same as target: the schedule above for both (the paper's pair: both 4-step models). Not with refine_from_step, which continues a draft on the target's schedule."),
                io.Combo.Input("drafter_step_noise", options=DRAFTER_STEP_NOISES, default=SAME, optional=True, tooltip="The drafter's own step noise (a distilled drafter: fresh). same as target: step_noise above for both."),
            ],
            outputs=[
                io.Image.Output(display_name="images", tooltip="All frames [N, H, W, 3], for CreateVideo / SaveVideo."),
                io.Latent.Output(display_name="latent", tooltip="The final latents {'samples': [1, 16, F, H/8, W/8]} in ComfyUI's Wan 2.1 latent convention (core VAEDecode with the Wan VAE decodes them)."),
                io.String.Output(display_name="report", tooltip="JSON report: per-block decision, scores, τ, timings; totals (acceptance, speed-up estimate). Feed SDVG Report."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.dynprompt],
            # an output node: ComfyUI re-sends its ui output (the timeline) when a run is fully cached
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, seed: int, blocks: int, width: int, height: int, cache: str, schedule: str,
                        custom_schedule: str, refine_from_step: int, profile: str = DEFAULT_PROFILE,
                        positions: str = _C.positions, step_noise: str = _S.step_noise, drafter_schedule: str = SAME,
                        drafter_step_noise: str = SAME) -> bool | str:
        """Queue-time check of the settings (ComfyUI calls it before running anything, so a bad size never
        costs a 14B load). ComfyUI skips its own range checks for the inputs named here: ours cover them."""
        try:
            sampler_config(seed=seed, blocks=blocks, width=width, height=height, cache=cache, schedule=schedule,
                           custom_schedule=custom_schedule, refine_from_step=refine_from_step, profile=profile,
                           positions=positions, step_noise=step_noise, drafter_schedule=drafter_schedule,
                           drafter_step_noise=drafter_step_noise)
        except ConfigError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, vae, conditioning, router, seed: int, blocks: int, width: int, height: int, cache: str,
                schedule: str, custom_schedule: str, pipelined: bool, refine_from_step: int, on_cancel: str = "stop",
                profile: str = DEFAULT_PROFILE, positions: str = _C.positions, step_noise: str = _S.step_noise,
                drafter: DiTHandle | None = None, target: DiTHandle | None = None, reward=None, start=None,
                on_fault: str = ON_FAULT[0], drafter_schedule: str = SAME,
                drafter_step_noise: str = SAME) -> io.NodeOutput:
        from ..sdvg.sampling import SpeculativeSampler

        config = sampler_config(seed=seed, blocks=blocks, width=width, height=height, cache=cache, schedule=schedule,
                                custom_schedule=custom_schedule, pipelined=pipelined, refine_from_step=refine_from_step,
                                profile=profile, positions=positions, step_noise=step_noise,
                                drafter_schedule=drafter_schedule, drafter_step_noise=drafter_step_noise)
        warn_large_image(config)
        models = _run_models(router, drafter, target, vae, reward)
        # a copy bound to this run (seed for random routing); the input is untouched
        router = dataclasses.replace(router, seed=int(seed) % (2**63))
        sampler = SpeculativeSampler(models, router, config)  # validates: ConfigError reaches the user as is
        node_id = str(cls.hidden.unique_id) if cls.hidden is not None and cls.hidden.unique_id is not None else "0"
        keep = on_cancel == "keep finished blocks"
        with ExitStack() as stack:
            stream = stack.enter_context(BlockStream(node_id, _display_id(cls.hidden, node_id), config.num_blocks,
                                                     keep_on_cancel=keep))
            stream.start(config.width, config.height, router)
            stack.enter_context(_parked_after((drafter, target)))
            _bring_models(config, sampler.router_config, models, (drafter, target, vae, reward))
            result, fault = _streamed_run(sampler, conditioning, start, stream, keep,
                                          keep_on_fault=on_fault == ON_FAULT[0])
            report = result.report()
            if fault is not None:
                report["fault"] = fault
            stream.done(report)
        return io.NodeOutput(*node_outputs(result, vae.model), json.dumps(to_jsonable(report), indent=1),
                             ui=stream.ui())


def _run_models(router, drafter: DiTHandle | None, target: DiTHandle | None, vae, reward):
    """The run's model bundle: a DiT is read from its file here, the first time a run needs it (and only if this
    routing mode calls it)."""
    from ..sdvg.loaders import SDVGModels

    return SDVGModels(target=_model_for(target, runs_model(router.mode, "target")),
                      drafter=_model_for(drafter, runs_model(router.mode, "drafter")),
                      vae=vae.model, reward=getattr(reward, "model", None))


def _streamed_run(sampler, conditioning, start, stream: BlockStream, keep: bool, *, keep_on_fault: bool):
    """One run, each block streamed to the canvas → (result, fault message or None). Cancel ends the prompt, or
    (``keep``) the graph goes on with the finished blocks; a fault after at least one finished block is kept
    (``keep_on_fault``): its blocks are the result and the message goes on the node."""
    from ..sdvg import RunFailed
    from ..sdvg.sampling import InitBlocks

    prompt, embeds = conditioning.sampler_prompt()
    init = start if isinstance(start, InitBlocks) else None
    video = start if start is not None and init is None else None
    try:
        result = sampler.run(prompt, prompt_embeds=embeds, init=init, video=video, on_block=stream.block,
                             on_step=stream.step, cancel=_host.processing_interrupted)
    except RunFailed as exc:
        if not keep_on_fault or not exc.result.blocks:
            raise
        logger.error("SDVG: %s Returning the %d finished block(s) (on_fault: keep finished blocks).", exc,
                     len(exc.result.blocks))
        return exc.result, str(exc)
    if result.partial and keep:
        _host.clear_interrupt()  # the graph goes on with the finished blocks
        logger.warning("cancelled: returning the %d finished block(s)", len(result.blocks))
    elif result.partial:
        _host.raise_if_interrupted()  # ComfyUI's InterruptProcessingException: the host marks it interrupted
    return result, None


def warn_large_image(config) -> None:
    """The IMAGE output is one float32 batch of every frame: say so when it gets big (it is refused beyond RAM)."""
    from ..sdvg import pixel_frames_for_blocks

    frames = pixel_frames_for_blocks(config.num_blocks)
    size = frames * config.width * config.height * 3 * 4
    if size > IMAGE_WARN_BYTES:
        logger.warning("SDVG: %d blocks at %dx%d make an IMAGE batch of %d frames (%.1f GiB of RAM, more downstream). "
                       "For long videos the CLI streams frames to disk instead: python -m sdvg generate --out x.mp4.",
                       config.num_blocks, config.width, config.height, frames, size / 2**30)


def node_outputs(result, vae) -> tuple[torch.Tensor, dict]:
    """IMAGE (float32 on ComfyUI's intermediate device) and LATENT in ComfyUI's Wan 2.1 convention: the raw VAE
    space (``StreamingVAE.denormalize``), so core VAEDecode with the Wan VAE decodes them."""
    dev = _host.intermediate_device()
    frames = result.frames
    if frames.dtype == torch.uint8:
        frames = frames.to(torch.float32) / 255.0
    latents = result.latents
    latents = vae.denormalize(latents) if latents.numel() else latents.to(torch.float32)
    return frames.to(dev, torch.float32), {"samples": latents.to(dev, torch.float32)}
