"""The model stages of one run, each with its collaborators handed in: denoising a block with either DiT
(:class:`Denoising`: the run's noise, schedules, cancel and step callbacks), decoding it (:class:`Decoding`: the
streaming VAE) and scoring its frames (:class:`Scoring`: the reward model). Each is timed by the run meter and
announced to the call observers (``calls.py``); none reaches back into the run, so the verifier (``verify.py``) and
the block loop (``sampler.py``) use them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import CancelledError, NonFiniteError
from .calls import Hooks
from .causal import BlockDenoiser
from .history import BlockHistory, DenoiseResult, HistoryBlock
from .meter import RunMeter
from .results import StepEvent
from .routing import FrameScores
from .scheduler import NoiseBank

if TYPE_CHECKING:
    from .conditioning_frames import VideoToVideo
    from .config import SamplerConfig

EARLY_EXIT_CHUNK = 3  # frames scored per forward when the router may stop at the first frame below τ


def finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


@dataclass
class Draft:
    block: int
    result: DenoiseResult
    base: int | None  # token of the last history block it was drafted on (None: drafted on an empty history)
    finite: bool = True  # False: the drafter produced NaN/inf latents; the draft is rejected without decoding

    @property
    def history_block(self) -> HistoryBlock:
        return HistoryBlock.of(self.block, self.result)


def last_token(history: BlockHistory) -> int | None:
    return history.blocks[-1].token if len(history) else None


class Denoising:
    """One block denoised by one DiT from the run's shared noise: its cache brought up to the history first (deferred
    work), then its schedule's steps, cancel polled before each. ``denoisers`` is filled once they are started."""

    def __init__(self, config: SamplerConfig, schedules: dict[str, list], noise: NoiseBank, meter: RunMeter, *,
                 video: VideoToVideo | None = None, cancel: Callable[[], bool] | None = None,
                 on_step: Callable[[StepEvent], None] | None = None) -> None:
        self.config, self.schedules, self.noise, self.meter = config, schedules, noise, meter
        self.video, self.cancel, self.on_step = video, cancel, on_step
        self.denoisers: dict[str, BlockDenoiser] = {}

    @property
    def has_target(self) -> bool:
        return "target" in self.denoisers

    def device(self, model: str) -> torch.device:
        return self.denoisers[model].device

    def denoise(self, model: str, block: int, history: BlockHistory, timings: dict, **kwargs) -> DenoiseResult:
        den = self.denoisers[model]
        with self.meter.phase(timings, "cache", den.device):
            den.sync(history)
        noise = self.noise.get(block, den.device, den.dtype)
        steps = self.schedules[model][block]
        if self.video is not None:  # video-to-video: the block starts from the input's latents at the strength
            kwargs = {**kwargs, "start_step": self.video.start_step(steps), "x0_init": self.video.block(block)}
        with self.meter.denoise(model, timings, den.device):
            result = den.denoise(block, noise, steps, on_step=self._step_hook(block, model),
                                 step_noise=self.config.step_noise_for(model), **kwargs)
            if model == "target" and not finite(result.x0):  # a drafter's NaN only rejects its draft (draft)
                raise NonFiniteError(
                    f"The target produced NaN/inf latents in block {block}. Load the DiTs in bf16 or fp32 (fp16 and "
                    "plain fp8 can overflow), or check the target checkpoint."
                )
        return result

    def draft(self, block: int, history: BlockHistory, timings: dict) -> Draft:
        """The drafter's block on ``history``; step stitch keeps its x0 of step k − 1 for a rejecting target."""
        keep = self.config.refine_from_step - 1 if self.config.stitch else None
        result = self.denoise("drafter", block, history, timings, keep_x0_step=keep)
        return Draft(block, result, last_token(history), finite=finite(result.x0))

    def regenerate(self, block: int, draft: Draft, history: BlockHistory, timings: dict) -> DenoiseResult:
        """The target redoes a rejected block from the same noise, or takes over at step k: the state
        ``renoise(x0, ε_k−1, σ_k)`` from the draft's final x0 (refine-on-reject) or from the drafter's own x0 of step
        k − 1 (step stitch: exactly the drafter's input of step k, so its first k steps are kept)."""
        k = self.config.refine_from_step
        if k is not None and k < len(self.schedules["target"][block]):
            src = draft.result.x0_kept if self.config.stitch else draft.result.x0
            x0 = src.to(self.device("target"))
            return self.denoise("target", block, history, timings, start_step=k, x0_init=x0)
        return self.denoise("target", block, history, timings)

    def _step_hook(self, block: int, model: str):
        def hook(step: int, num_steps: int) -> None:
            try:
                stop = self.cancel is not None and self.cancel()
                if not stop and self.on_step is not None:
                    self.on_step(StepEvent(block, model, step, num_steps))
            except Exception as exc:  # the caller's own exception (a host's interrupt): passed on unchanged
                exc.sdvg_from_callback = True
                raise
            if stop:
                raise CancelledError(f"cancelled at block {block}, {model} step {step}")

        return hook


class Decoding:
    """The streaming VAE: decode a block's latents (checked finite), snapshot and restore its state."""

    def __init__(self, vae, meter: RunMeter, hooks: Hooks) -> None:
        self.vae, self.meter, self.hooks = vae, meter, hooks
        self.device = torch.device(getattr(vae, "device", "cpu"))

    def decode(self, latents: torch.Tensor, timings: dict) -> torch.Tensor:
        with self.meter.phase(timings, "decode", self.device):
            with self.hooks.call("decode", (self.vae.frames_decoded == 0, int(latents.shape[2]))):
                frames = self.vae.decode_block(latents)
            if not finite(frames):
                raise NonFiniteError(
                    "The VAE decoder produced NaN/inf pixels from finite latents. Load the VAE in fp32 or bf16 (fp16 "
                    "overflows), or check the VAE file."
                )
            return frames

    def snapshot(self):
        return self.vae.snapshot()

    def restore(self, state) -> None:
        self.vae.restore(state)


class Scoring:
    """The reward model: a block's frames scored against the prompt in force at that block."""

    def __init__(self, reward, meter: RunMeter, hooks: Hooks, device: torch.device, prompt_at: Callable[[int], str],
                 preprocess: str) -> None:
        self.reward, self.meter, self.hooks, self.device = reward, meter, hooks, device
        self.prompt_at, self.preprocess = prompt_at, preprocess

    def score(self, block: int, frames: torch.Tensor, timings: dict) -> torch.Tensor:
        with self.meter.phase(timings, "score", self.device), self.hooks.call("score", (int(frames.shape[0]),)):
            return self.reward.score(frames, self.prompt_at(block), preprocess=self.preprocess)

    def frame_scores(self, block: int, frames: torch.Tensor, timings: dict) -> FrameScores:
        """The block's scores as the router asks for them: some frames, all, or chunk by chunk (early exit)."""
        def score(idx: list[int] | None) -> torch.Tensor:
            return self.score(block, frames if idx is None else frames[idx], timings)

        def chunks() -> Iterator[torch.Tensor]:
            with self.meter.phase(timings, "score", self.device), self.hooks.call("score", (int(frames.shape[0]),)):
                yield from self.reward.score_chunks(frames, self.prompt_at(block), EARLY_EXIT_CHUNK,
                                                    preprocess=self.preprocess)

        return FrameScores(int(frames.shape[0]), score, chunks)
