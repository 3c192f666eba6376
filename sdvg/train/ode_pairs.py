"""Teacher ODE pairs: (noise, prompt) → the teacher's video from that noise, made once per run and cached.

This is the regression data of CausVid's and Self-Forcing's *ODE initialization* and of DiagDistill's
teacher-trajectory regression term (``lambda_reg`` in its DMD loss): the student's exit-step x0, rolled out from the
pair's initial noise, is also regressed onto the teacher's video from the same noise. DMD alone has to discover the
teacher's modes from the fake score's feedback; the pairs give the student a deterministic target for each noise (the
teacher's sampler is a deterministic map when it takes ODE steps, ``teacher_step_noise = "predicted"``).

The teacher runs on the same rollout code as the student (``rollout.py``), with its own schedule and cache, every
block to its last step. ``<out>/ode_pairs.pt`` is reused while its settings match.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..loaders.checkpoint import torch_load
from ..sampling.scheduler import FlowMatchScheduler, build_step_schedule
from .rollout import RolloutNoise, rollout

logger = logging.getLogger(__name__)
CHUNK = 32


@dataclass
class OdePairs:
    noise: torch.Tensor  # [N, C, F, h, w]
    prompts: torch.Tensor  # [N] indices into the prompt bank
    x0: torch.Tensor  # [N, C, F, h, w]: the teacher's video
    states: list[torch.Tensor]  # per block [N, steps_b, C, fpb, h, w]: the teacher's path at the student's timesteps

    def inputs(self, pick: torch.Tensor, exits: list[int]) -> torch.Tensor:
        """The teacher's path states at each block's exit timestep: ``[n, C, F, h, w]``."""
        return torch.cat([st[pick, k] for st, k in zip(self.states, exits, strict=True)], 2)


def teacher_schedule(cfg, student: list[list[float]]) -> list[list[float]]:
    """The teacher's own steps merged with the student's, so its path passes every timestep the student starts from."""
    from ..toy.preset import TOY_SCHEDULE

    spec = cfg.teacher_schedule if cfg.teacher_schedule is not None else TOY_SCHEDULE
    own = build_step_schedule(spec, cfg.num_blocks, FlowMatchScheduler(cfg.shift))
    return [sorted(set(a) | set(b), reverse=True) for a, b in zip(own, student, strict=True)]


def _key(cfg, teacher_file: str, student: list[list[float]]) -> dict:
    return {"n": cfg.ode_pairs, "seed": cfg.seed, "teacher": str(teacher_file), "schedule": student,
            "teacher_schedule": teacher_schedule(cfg, student),
            "step_noise": cfg.teacher_step_noise, "cache": cfg.teacher_cache, "blocks": cfg.num_blocks,
            "latent_hw": list(cfg.latent_hw)}


def make_pairs(teacher, bank, cfg, teacher_file: str, out: Path | None, student: list[list[float]]) -> OdePairs:
    """The run's pairs: loaded from ``out/ode_pairs.pt`` when its settings match, else made (and cached)."""
    key = _key(cfg, teacher_file, student)
    path = out / "ode_pairs.pt" if out is not None else None
    if path is not None and path.is_file():
        st = torch_load(path)
        if st.get("key") == key:
            return OdePairs(st["noise"], st["prompts"], st["x0"], list(st["states"]))
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
    h, w = cfg.latent_hw
    c = teacher.config.in_channels
    shape = (cfg.ode_pairs, c, cfg.num_blocks * cfg.frames_per_block, h, w)
    prompts = bank.draw(gen, cfg.ode_pairs)
    noise = torch.randn(shape, generator=gen)
    sched = teacher_schedule(cfg, student)
    at = [[row.index(t) for t in srow] for row, srow in zip(sched, student, strict=True)]
    sch = FlowMatchScheduler(cfg.shift)
    x0s, states = [], [[] for _ in sched]
    for lo in range(0, cfg.ode_pairs, CHUNK):
        sl = slice(lo, lo + CHUNK)
        n = noise[sl].shape[0]
        renoise = [[torch.randn((n, c, cfg.frames_per_block, h, w), generator=gen) for _ in row[:-1]]
                   for row in sched] if cfg.teacher_step_noise == "fresh" else [[] for _ in sched]
        roll = rollout(teacher, bank(prompts[sl]), RolloutNoise(noise[sl], renoise), sched,
                       [len(r) - 1 for r in sched], cache=cfg.teacher_cache, scheduler=sch,
                       fpb=cfg.frames_per_block, step_noise=cfg.teacher_step_noise, record=True)
        x0s.append(roll.x0.float().cpu())
        for b, idx in enumerate(at):
            states[b].append(torch.stack([roll.states[b][i].float().cpu() for i in idx], 1))
    pairs = OdePairs(noise, prompts, torch.cat(x0s), [torch.cat(s) for s in states])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "noise": pairs.noise, "prompts": pairs.prompts, "x0": pairs.x0,
                    "states": pairs.states}, str(path))
    logger.info("made %d teacher ODE pairs", cfg.ode_pairs)
    return pairs
