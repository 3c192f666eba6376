"""SDVGSpeculativeSampler: runs the engine's SpeculativeSampler and streams each block to the canvas.

Per finished block it sends exactly one preview (a contact sheet of the block's frames) through ComfyUI's
ProgressBar on this node, and one ``sdvg.block`` websocket event with the routing decision. Per denoising
step it updates the progress bar. Cancel is polled before every model call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time

import torch
from comfy_api.latest import io

from . import _host
from .handles import DiTHandle
from .preview import PreviewEncoder
from .types import SDVG_CONDITIONING, SDVG_DIT, SDVG_REWARD, SDVG_ROUTER, SDVG_VAE

logger = logging.getLogger(__name__)

CACHE_REGIMES = ["recompute", "global", "noisy"]
SCHEDULES = ["constant", "diagonal", "custom"]
PREVIEW_MAX_SIDE = 512
PROGRESS_PER_BLOCK = 100
MAX_BLOCKS = 64
EVENT_BLOCK = "sdvg.block"
EVENT_START = "sdvg.start"
EVENT_DONE = "sdvg.done"
EVENT_PREVIEW = "sdvg.preview"  # {node, display_node, block}: the next preview image of this node shows this block


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _frame_stats(scores: list) -> dict | None:
    values = [s for s in scores if isinstance(s, float) and math.isfinite(s)]
    if not values:
        return None
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values), "count": len(values)}


def block_payload(node_id: str, display_node_id: str, record, num_blocks: int, num_frames: int) -> dict:
    """The JSON body of one ``sdvg.block`` event (also what the web timeline renders).

    ``kind`` is the outcome the timeline colours: accept (draft kept) / reject (draft rejected, the target
    regenerated the block) / forced (the target made it without a draft: block 0, target-only), as in
    ``sdvg.report.block_kind``; ``drafted`` and ``produced_by`` are the record's own fields it is derived from.
    ``q`` and ``scores`` are the scores the router decided on (the draft's, for accept and reject);
    ``frame_stats`` is their min / mean / max."""
    from ..sdvg.report import block_kind

    data = record.to_dict() if hasattr(record, "to_dict") else dict(record)
    scores = [_finite(float(s)) for s in data.get("scores") or []]
    return {
        "node": node_id,
        "display_node": display_node_id,
        "block": int(data["block"]),
        "num_blocks": num_blocks,
        "kind": block_kind(data),
        "decision": data.get("decision"),
        "reason": data.get("reason"),
        "produced_by": data.get("produced_by"),
        "drafted": bool(data.get("drafted")),
        "q": _finite(data.get("q")),
        "scores": scores,
        "frame_stats": _frame_stats(scores),
        "tau": _finite(data.get("tau")),
        "aggregation": data.get("aggregation"),
        "steps": data.get("steps"),
        "frames": num_frames,
        "timings": {k: round(float(v), 4) for k, v in (data.get("timings") or {}).items()},
    }


class _Progress:
    """Monotonic per-node progress: each block is PROGRESS_PER_BLOCK units, split between drafter and target."""

    def __init__(self, num_blocks: int, node_id: str):
        self.total = num_blocks * PROGRESS_PER_BLOCK
        self.value = 0
        self.bar = _host.progress_bar(self.total, node_id)

    def step(self, block: int, model: str, step: int, num_steps: int) -> None:
        half = PROGRESS_PER_BLOCK // 2
        start = block * PROGRESS_PER_BLOCK + (half if model == "target" else 0)
        self._set(start + int(half * (step + 1) / max(1, num_steps)) - 1)

    def block_done(self, block: int, preview=None) -> None:
        self._set((block + 1) * PROGRESS_PER_BLOCK, preview)

    def preview(self, image) -> None:
        self._set(self.value, image)

    def _set(self, value: int, preview=None) -> None:
        self.value = max(self.value, min(value, self.total))
        if self.bar is not None:
            self.bar.update_absolute(self.value, self.total, ("JPEG", preview, PREVIEW_MAX_SIDE) if preview is not None else None)


def _place(handle: DiTHandle | None) -> None:
    if handle is not None and handle.offload != "keep_loaded":
        handle.model.to(handle.device)


def _park(handles: list[DiTHandle | None]) -> None:
    moved = False
    for handle in handles:
        if handle is not None and handle.offload != "keep_loaded" and handle.device.type != "cpu":
            handle.model.to("cpu")
            moved = True
    if moved:
        _host.soft_empty_cache()


def _display_id(hidden, node_id: str) -> str:
    dynprompt = getattr(hidden, "dynprompt", None) if hidden is not None else None
    if dynprompt is not None and hasattr(dynprompt, "get_display_node_id"):
        try:
            return str(dynprompt.get_display_node_id(node_id))
        except Exception:
            logger.debug("display id lookup failed", exc_info=True)
    return node_id


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
                SDVG_CONDITIONING.Input("conditioning", tooltip="Prompt embeddings and text from SDVG Text Encode."),
                SDVG_ROUTER.Input("router", tooltip="The acceptance rule (SDVG Reward Router)."),
                SDVG_REWARD.Input("reward", optional=True, tooltip="ImageReward scorer. Needed in routing mode 'reward' (and for threshold modes that score the target)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFF, control_after_generate=True, tooltip="Noise seed. Each block's noise depends only on (seed, block), never on routing."),
                io.Int.Input("blocks", default=7, min=1, max=MAX_BLOCKS, tooltip="Number of 3-latent-frame blocks. Pixel frames = 12 × blocks − 3 (7 blocks = 81 frames ≈ 5 s at 16 fps)."),
                io.Int.Input("width", default=832, min=16, max=2048, step=16, tooltip="Frame width in pixels, a multiple of 16 (both models were trained at 832×480)."),
                io.Int.Input("height", default=480, min=16, max=2048, step=16, tooltip="Frame height in pixels, a multiple of 16."),
                io.Combo.Input(
                    "cache",
                    options=CACHE_REGIMES,
                    default="recompute",
                    tooltip="KV-cache regime. recompute: Krea/SDVG windowed recompute (reference). global: Self-Forcing cache with a clean pass per block. noisy: Diagonal forcing, no clean pass, rolling window with sink frames.",
                ),
                io.Combo.Input(
                    "schedule",
                    options=SCHEDULES,
                    default="constant",
                    tooltip="Denoising steps per block. constant: 4 warped Self-Forcing steps for every block. diagonal: Diagonal Distillation, more steps early, fewer later. custom: the list typed below.",
                ),
                io.String.Input(
                    "custom_schedule",
                    default="1000,750,500,250",
                    tooltip="Used when schedule = custom: one comma list of timesteps (0 < t ≤ 1000, decreasing; warped to the shifted table) for all blocks, or a JSON list of lists per block (the last repeats).",
                ),
                io.Boolean.Input("pipelined", default=False, tooltip="Overlap verification (decode + score of block b) with drafting block b+1 on a second thread. Faster on two GPUs; a rejected block discards the early draft."),
                io.Int.Input("refine_from_step", default=0, min=0, max=16, tooltip="0 = a rejected block is regenerated by the target from scratch (paper). k ≥ 1 = the target starts at step k from the re-noised draft (cheaper, experimental)."),
            ],
            outputs=[
                io.Image.Output(display_name="images", tooltip="All frames [N, H, W, 3], for CreateVideo / SaveVideo."),
                io.Latent.Output(display_name="latent", tooltip="The final latents {'samples': [1, 16, F, H/8, W/8]} in ComfyUI's Wan 2.1 latent convention (core VAEDecode with the Wan VAE decodes them)."),
                io.String.Output(display_name="report", tooltip="JSON report: per-block decision, scores, τ, timings; totals (acceptance, speed-up estimate). Feed SDVG Report."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.dynprompt],
        )

    @classmethod
    def execute(
        cls,
        vae,
        conditioning,
        router,
        seed: int,
        blocks: int,
        width: int,
        height: int,
        cache: str,
        schedule: str,
        custom_schedule: str,
        pipelined: bool,
        refine_from_step: int,
        drafter: DiTHandle | None = None,
        target: DiTHandle | None = None,
        reward=None,
    ) -> io.NodeOutput:
        from ..sdvg.errors import ConfigError
        from ..sdvg.pipeline import SDVGModels
        from ..sdvg.regimes import CacheConfig, CacheRegime
        from ..sdvg.sampler import SamplerConfig, SpeculativeSampler

        if schedule not in SCHEDULES:
            raise ConfigError(f"Unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
        if cache not in CACHE_REGIMES:
            raise ConfigError(f"Unknown cache regime {cache!r}; use one of {', '.join(CACHE_REGIMES)}.")
        spec = custom_schedule.strip() if schedule == "custom" else schedule
        if not spec:
            raise ConfigError("schedule is 'custom' but custom_schedule is empty; type e.g. 1000,750,500,250.")
        node_id = str(cls.hidden.unique_id) if cls.hidden is not None and cls.hidden.unique_id is not None else "0"
        display_id = _display_id(cls.hidden, node_id)

        models = SDVGModels(
            target=target.model if target is not None else None,
            drafter=drafter.model if drafter is not None else None,
            vae=vae.model,
            text_encoder=None,
            reward=reward.model if reward is not None else None,
        )
        config = SamplerConfig(
            num_blocks=int(blocks),
            width=int(width),
            height=int(height),
            seed=int(seed),
            cache=CacheConfig(regime=CacheRegime(cache)),
            schedule=spec,
            pipelined=bool(pipelined),
            refine_from_step=int(refine_from_step) or None,
        )
        # a copy bound to this run (seed for random routing, length for the target-rate correction); the input is untouched
        router = dataclasses.replace(router, seed=int(seed) % (2**63), num_blocks=int(blocks))
        sampler = SpeculativeSampler(models, router, config)  # validates: ConfigError reaches the user as is

        progress = _Progress(config.num_blocks, node_id)
        encoder = PreviewEncoder(max_side=PREVIEW_MAX_SIDE)
        sent_previews: set[int] = set()

        def flush_previews(items) -> None:
            for block, image in items:
                if block not in sent_previews:
                    sent_previews.add(block)
                    _host.send_event(EVENT_PREVIEW, {"node": node_id, "display_node": display_id, "block": block})
                    progress.preview(image)

        def on_step(event) -> None:
            flush_previews(encoder.ready())
            progress.step(event.block, event.model, event.step, event.num_steps)

        _host.send_event(
            EVENT_START,
            {"node": node_id, "display_node": display_id, "num_blocks": config.num_blocks, "width": width, "height": height,
             "tau": _finite(float(getattr(router, "tau", float("nan")))), "mode": getattr(router, "mode", None)},
        )
        started = time.perf_counter()
        _place(drafter)
        _place(target)
        gen = None
        try:
            gen = sampler.generate(
                conditioning.prompt, prompt_embeds=conditioning.embeds, cancel=_host.processing_interrupted, on_step=on_step
            )
            while True:
                try:
                    event = next(gen)
                except StopIteration as stop:
                    result = stop.value
                    break
                encoder.submit(event.block, event.frames)
                progress.block_done(event.block)
                _host.send_event(EVENT_BLOCK, block_payload(node_id, display_id, event.record, config.num_blocks, int(event.frames.shape[0])))
                flush_previews(encoder.ready())
            flush_previews(encoder.close())
        finally:
            if gen is not None:
                gen.close()  # a Cancel raised between blocks: let the engine release its state (verify thread, caches)
            encoder.close(timeout=1.0)
            _park([drafter, target])
        if result.partial:
            _host.raise_if_interrupted()  # ComfyUI's InterruptProcessingException: the host marks the prompt interrupted
        report = result.report()
        report.setdefault("node", {})["preview_dropped"] = encoder.dropped
        _host.send_event(EVENT_DONE, {"node": node_id, "display_node": display_id, "totals": _jsonable(report.get("totals")),
                                      "wall_s": round(time.perf_counter() - started, 3)})

        dev = _host.intermediate_device()
        frames = result.frames
        if frames.dtype == torch.uint8:
            frames = frames.to(torch.float32) / 255.0
        frames = frames.to(dev, torch.float32)
        latents = comfy_latent(result.latents, vae.model).to(dev, torch.float32)
        return io.NodeOutput(frames, {"samples": latents}, json.dumps(_jsonable(report), indent=1))


def comfy_latent(latents: torch.Tensor, vae) -> torch.Tensor:
    """Normalized Wan latents (what the DiTs see) → ComfyUI's LATENT convention for Wan 2.1 (the raw VAE space,
    ``StreamingVAE.denormalize``), so core VAEDecode with the Wan VAE decodes them."""
    if latents.numel() == 0:
        return latents.to(torch.float32)
    return vae.denormalize(latents)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return value
