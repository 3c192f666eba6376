"""Measure distilled students on the toy world: the judge's caption accuracy (with a bootstrap interval over
prompts × seeds), motion amplitude, per-forward cost, and quality by block index on long rollouts.

A student is sampled the way it was trained: its schedule (diagonal or constant), fresh noise between steps, and the
cache it was trained with (``noisy`` regime for diagonal forcing, ``global`` = clean pass for the clean cache). The
toy target (the teacher) is sampled the way the sampler runs it by default, with the ``recompute`` cache: under the
students' noisy cache it scores 0.323 [0.247, 0.406] on the 72 held-out captions × seed 9000, against 0.715
[0.653, 0.774] with recompute, so a teacher row on the noisy cache would flatter every student.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..eval.stats import mean_ci
from ..sampling.regimes import CacheConfig

#: the long-rollout cache: noisy, a rolling window of the training length (9 frames) with 3 pinned sinks at
#: window-relative RoPE positions, so no position past the training length is ever used
LONG_WINDOW = {"window_frames": 9, "sink_frames": 3, "positions": "window"}


@dataclass
class Sampling:
    """How to sample one model for a measurement row."""

    name: str
    drafter: str | None  # None: the toy target itself (target-only)
    schedule: str | list = "diagonal"
    step_noise: str = "fresh"
    #: noisy (diagonal forcing's) | clean (the global regime's clean pass) | recompute (the sampler's default);
    #: None: as the model is run, noisy for a student and recompute for the toy target
    cache: str | None = None
    extra: dict = field(default_factory=dict)

    def cache_config(self, num_blocks: int) -> CacheConfig:
        cache = self.cache or ("recompute" if self.drafter is None else "noisy")
        if cache == "clean":
            return CacheConfig(regime="global")
        if cache == "recompute":
            return CacheConfig()
        return CacheConfig(regime="noisy", **(LONG_WINDOW if num_blocks * 3 > 9 else {}))


def motion_amplitude(frames: torch.Tensor) -> float:
    """Mean absolute difference of consecutive frames (pixels in [0, 1]): how much the video moves."""
    f = frames.float() / 255 if frames.dtype == torch.uint8 else frames.float()
    return float((f[1:] - f[:-1]).abs().mean())


def _first_frame(block: int) -> int:
    """The first pixel frame of ``block`` (block 0 decodes to 9 frames, later blocks to 12)."""
    return 0 if block == 0 else 9 + 12 * (block - 1)


def _video(models, s: Sampling, caption: str, seed: int, num_blocks: int):
    from ..sampling.config import SamplerConfig
    from ..sampling.router import RouterConfig
    from ..sampling.sampler import SpeculativeSampler
    from ..toy.preset import TOY_SCHEDULE, TOY_SIZE, TOY_STEP_NOISE

    target = s.drafter is None  # the toy target itself, on its own schedule and ODE steps
    cfg = SamplerConfig(num_blocks=num_blocks, width=TOY_SIZE[0], height=TOY_SIZE[1], seed=seed,
                        schedule=TOY_SCHEDULE if target else s.schedule,
                        step_noise=TOY_STEP_NOISE if target else s.step_noise, cache=s.cache_config(num_blocks))
    mode = "target-only" if target else "draft-only"
    return SpeculativeSampler(models, RouterConfig(mode=mode), cfg.validate()).run(caption)


def _mean_ci(values: list[float], name: str) -> dict:
    mean, lo, hi = mean_ci(values)
    return {name: mean, f"{name}_lo": lo, f"{name}_hi": hi}


def measure(models_for, s: Sampling, prompts: list[str], seeds: list[int], *, num_blocks: int = 3,
            per_block: bool = False, reference: Sampling | None = None) -> dict:
    """One row: judge mean and 95 % interval, the ungated attribute accuracy, object-frame rate and palette fit
    beside it, smoothness, motion amplitude, seconds per video (with ``per_block``, the judge on each 3-block window
    by its last block; with ``reference``, the judge's agreement with the reference's video from the same seed)."""
    import time

    from ..toy.judge import agreement, judge

    models = models_for(s.drafter)
    ref_models = models_for(reference.drafter) if reference is not None else None
    accs, motion, smooth, secs = [], [], [], []
    extra: dict[str, list[float]] = {"ungated": [], "object_frames": [], "palette": [], "agreement": []}
    windows: dict[int, list[float]] = {}
    for seed in seeds:
        for caption in prompts:
            t0 = time.perf_counter()
            res = _video(models, s, caption, seed, num_blocks)
            secs.append(time.perf_counter() - t0)
            v = judge(res.frames, caption)
            accs.append(v.accuracy)
            extra["ungated"].append(v.ungated)
            extra["object_frames"].append(v.checks["object_frames"])
            extra["palette"].append(v.checks["palette"])
            if reference is not None:
                ref = _video(ref_models, reference, caption, seed, num_blocks)
                extra["agreement"].append(agreement(res.frames, ref.frames, caption))
            smooth.append(v.smooth)
            motion.append(motion_amplitude(res.frames))
            if per_block:
                for last in range(2, num_blocks):  # the window of three blocks ending at ``last``
                    clip = res.frames[_first_frame(last - 2):_first_frame(last + 1)]
                    windows.setdefault(last, []).append(judge(clip, caption).accuracy)
    row = {"name": s.name, **_mean_ci(accs, "judge"),
           "smooth": sum(smooth) / len(smooth), "motion": sum(motion) / len(motion),
           "motion_sd": float(torch.tensor(motion).std()), "s_per_video": sum(secs) / len(secs), "n": len(accs),
           "accuracies": accs}
    for name, values in extra.items():
        if values:
            row.update(_mean_ci(values, name))
    if per_block:
        row["by_block"] = {b: sum(v) / len(v) for b, v in windows.items()}
    return row


def teacher_fidelity(student_file: str, cfg, *, n: int = 64, seed: int = 1000, step_noise: str = "fresh") -> dict:
    """How close the student's videos are to the teacher's from the same noise and caption: latent MSE per video
    (mean and 95 % interval over ``n`` held-out pairs, drawn with another seed than training's), the student sampled
    on its schedule and cache with ``step_noise``. Lower is closer; the teacher's own videos score 0."""
    from dataclasses import replace

    from ..loaders.wan import load_dit
    from ..sampling.scheduler import FlowMatchScheduler, build_step_schedule
    from ..toy.preset import toy_files
    from .data import load_prompts
    from .ode_pairs import make_pairs
    from .rollout import RolloutNoise, rollout

    teacher_file = cfg.teacher or str(toy_files()["target"])
    held = replace(cfg, ode_pairs=n, seed=seed)
    sch = FlowMatchScheduler(cfg.shift)
    schedule = build_step_schedule(cfg.schedule, cfg.num_blocks, sch)
    bank = load_prompts(cfg.data, cfg.text_encoder, None)
    pairs = make_pairs(load_dit(teacher_file, dtype="fp32"), bank, held, teacher_file, None, schedule)
    student = load_dit(student_file, dtype="fp32")
    gen = torch.Generator().manual_seed(seed)
    noise = RolloutNoise.draw(gen, tuple(pairs.noise.shape), schedule, cfg.frames_per_block)
    noise.initial = pairs.noise
    roll = rollout(student, bank(pairs.prompts), noise, schedule, [len(r) - 1 for r in schedule], cache=cfg.cache,
                   scheduler=sch, fpb=cfg.frames_per_block, step_noise=step_noise)
    mse = ((roll.x0.float() - pairs.x0) ** 2).mean(dim=(1, 2, 3, 4)).tolist()
    return {**_mean_ci(mse, "mse"), "n": n}
