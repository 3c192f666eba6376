"""The sampler's settings (:class:`SamplerConfig`) and every check on them that needs no model: run
``validate()`` before loading anything (the CLI and the nodes do)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..blocks import FRAMES_PER_BLOCK, SPATIAL_MULTIPLE, VAE_SCALE, pixel_frames_for_blocks, rope_positions
from ..errors import ConfigError
from ..memory import physical_memory_bytes
from .compat import Compat
from .regimes import CacheConfig
from .scheduler import STEP_NOISES, FlowMatchScheduler, build_step_schedule, distinct_step_lists, with_tail_step

OUTPUT_DTYPES = ("float", "uint8")


@dataclass
class SamplerConfig:
    num_blocks: int = 7
    width: int = 832
    height: int = 480
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    schedule: str | Sequence[Sequence[float]] = "constant"
    # between steps: re-noise with fresh noise (Self-Forcing, Krea) or with the predicted noise (flow ODE, Euler
    # steps: flow-matching models that were not distilled, e.g. the toy world's)
    step_noise: str = "fresh"
    # the drafter's own schedule and step noise (a distilled few-step drafter beside an undistilled target, e.g. a
    # Diagonal Distillation student with the toy target); None: the same as the target's
    drafter_schedule: str | Sequence[Sequence[float]] | None = None
    drafter_step_noise: str | None = None
    pipelined: bool = False
    refine_from_step: int | None = None
    stitch: bool = False  # with refine_from_step k: the target continues the drafter's own step-k state (step stitch)
    num_frames: int | None = None  # trim the output to this many pixel frames
    output_dtype: str = "float"  # "float" ([0,1] float32) or "uint8"
    compat: Compat = field(default_factory=Compat)  # our defaults or the authors' behaviours (compat.py)
    # True: the result holds every frame and latent (RAM grows with the video). False: each block's frames reach
    # on_block only (stream them to disk) and the run holds a bounded tail: memory is flat in the block count.
    keep_output: bool = True

    def validate(self) -> SamplerConfig:
        """Every check that needs no model (run it before loading any); raises ConfigError. Returns self."""
        self._check_types()
        w, h, m = self.width, self.height, SPATIAL_MULTIPLE
        if w <= 0 or h <= 0 or w % m or h % m:
            raise ConfigError(
                f"Width and height must be positive multiples of {m}, got {w}×{h}. "
                f"Try {max(m, round(w / m) * m)}×{max(m, round(h / m) * m)}."
            )
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {self.num_blocks}.")
        if self.keep_output:
            self._check_output_fits()
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}.")
        shown = pixel_frames_for_blocks(self.num_blocks) - self.compat.dropped_frames
        if self.num_frames is not None and not 1 <= self.num_frames <= shown:
            raise ConfigError(f"num_frames {self.num_frames} does not fit {self.num_blocks} blocks ({shown} frames).")
        for name in ("step_noise", "drafter_step_noise"):
            value = getattr(self, name)
            if value not in STEP_NOISES and (name == "step_noise" or value is not None):
                raise ConfigError(f"{name} must be one of {', '.join(STEP_NOISES)}, got {value!r}.")
        if self.refine_from_step is not None and self.drafter_schedule is not None:
            raise ConfigError("refine_from_step continues a draft on the target's schedule; it needs one schedule for "
                              "both models (leave drafter_schedule unset).")
        self.step_schedule("drafter", distinct=True)
        if self.output_dtype not in OUTPUT_DTYPES:
            raise ConfigError(f"output_dtype must be 'float' or 'uint8', got {self.output_dtype!r}.")
        steps = max(len(row) for row in self.step_schedule(distinct=True))
        if self.refine_from_step is not None and not 1 <= self.refine_from_step < steps:
            raise ConfigError(
                f"refine_from_step must be between 1 and {steps - 1} (the schedule has {steps} steps; 0 or ≥ {steps} "
                f"would be a full regeneration), got {self.refine_from_step}."
            )
        return self

    def _check_types(self) -> None:
        for name in ("width", "height", "num_blocks", "seed", "num_frames", "refine_from_step"):
            value = getattr(self, name)
            optional = name in ("num_frames", "refine_from_step")
            if (value is None and not optional) or (value is not None and (isinstance(value, bool) or not isinstance(value, int))):
                raise ConfigError(f"{name} must be a whole number{' or None' if optional else ''}, got {value!r}.")
        if not isinstance(self.stitch, bool):
            raise ConfigError(f"stitch must be True or False, got {self.stitch!r}.")
        if self.stitch and self.refine_from_step is None:
            raise ConfigError("stitch needs refine_from_step = k: the step at which the target takes over the draft.")
        for name in ("pipelined", "keep_output"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if not isinstance(self.compat, Compat):
            raise ConfigError(f"compat must be a Compat (sdvg.compat.profile('reference')), got {self.compat!r}.")
        if not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {type(self.cache).__name__}.")

    def _check_output_fits(self) -> None:
        """The run keeps every output frame in RAM (float32): refuse a video that cannot fit before allocating it."""
        need = pixel_frames_for_blocks(self.num_blocks) * self.width * self.height * 3 * 4
        have = physical_memory_bytes()
        if have is not None and need > have:
            gib = 2**30
            raise ConfigError(
                f"{self.num_blocks} blocks at {self.width}×{self.height} need {need / gib:.1f} GiB for the output "
                f"frames alone, more than this machine's {have / gib:.1f} GiB of RAM. Use fewer blocks or a smaller size, "
                "or stream the frames to disk (keep_output=False; the CLI's --out does)."
            )

    def step_schedule(self, role: str = "target", *, distinct: bool = False) -> list[list[float]]:
        """Each block's timesteps for ``role`` (the drafter's own list when ``drafter_schedule`` is set);
        ``distinct``: only the lists before the last one repeats (what checks need, in time independent of the
        block count)."""
        spec = self.drafter_schedule if role == "drafter" and self.drafter_schedule is not None else self.schedule
        build = distinct_step_lists if distinct else build_step_schedule
        rows = build(spec, self.num_blocks, FlowMatchScheduler())
        return with_tail_step(rows) if self.compat.t0_tail_step else rows

    def step_noise_for(self, role: str) -> str:
        return self.drafter_step_noise if role == "drafter" and self.drafter_step_noise else self.step_noise

    def check_dit_fits(self, dit_config) -> None:
        """Refuse a size or a length that a DiT's RoPE table cannot position (from its config: a loaded model's or
        a file header's, so the CLI checks before anything loads)."""
        positions = rope_positions(dit_config)
        _, p_h, p_w = dit_config["patch_size"]
        h, w = self.latent_hw
        if max(h // p_h, w // p_w) > positions:
            raise ConfigError(f"{self.width}×{self.height} exceeds the model's RoPE range ({positions} tokens per "
                              "axis): use a smaller size.")
        self.cache.policy().check_length(self.num_blocks * FRAMES_PER_BLOCK, positions)

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // VAE_SCALE, self.width // VAE_SCALE
