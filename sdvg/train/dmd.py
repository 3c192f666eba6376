"""Distribution-matching distillation (DMD) losses with the flow (temporal-difference) distribution-matching term.

- **Scores.** A score model's x0 prediction of a noised generated video ``x_t = (1 − σ)·x0 + σ·ε`` (one σ per
  video, Self-Forcing's shifted, clamped timestep draw). ``causal`` scores (the toy teacher is block-causal): block b
  is predicted given the generated blocks before it, clean (``forward_with_context``), which is how such a model was
  trained; ``full``: one bidirectional forward (Wan 2.1's teacher).
- **Generator loss (DMD).** ``g = (x0_fake − x0_real) / mean|x0_gen − x0_real|`` (per video), and
  ``0.5·‖x0_gen − sg(x0_gen − g)‖²``: its gradient is ``g``.
- **Flow distribution matching** (weight ``flow_weight``, 0.2): the same construction on temporal differences
  ``Δx = x[:, :, 1:] − x[:, :, :-1]`` (the fake's and the real score's motion), normalized the same way, plus a
  small learnable *motion head* (1×1×1 convolutions on latent differences): the student's head on ``Δx0_gen`` is
  regressed onto an EMA copy of itself applied to the DMD target's differences, a learned motion feature matched
  between the student and where the teacher's score sends it.
- **Fake-score loss.** The ordinary flow-matching loss on the generated videos (``v = ε − x0``), same score view.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class MotionHead(torch.nn.Module):
    """A light motion-feature estimator on latent temporal differences ``[B, C, F−1, h, w]``."""

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv3d(channels, hidden, 1), torch.nn.SiLU(),
                                       torch.nn.Conv3d(hidden, hidden, 1))

    def forward(self, delta: torch.Tensor) -> torch.Tensor:
        return self.net(delta)


def frame_delta(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, 1:] - x[:, :, :-1]


@dataclass
class ScoreNoise:
    """The noise level and noise of a score evaluation (one σ per video)."""

    t: torch.Tensor  # [B] timesteps on 0..1000
    eps: torch.Tensor  # [B, C, F, h, w]

    @staticmethod
    def draw(gen: torch.Generator, shape: tuple[int, ...], *, min_t: float, max_t: float, shift: float) -> ScoreNoise:
        u = torch.rand(shape[0], generator=gen, dtype=torch.float64)
        s = shift * u / (1 + (shift - 1) * u)
        t = (s.clamp(min_t, max_t) * 1000).float()
        return ScoreNoise(t, torch.randn(shape, generator=gen))

    def shard(self, sl: slice) -> ScoreNoise:
        return ScoreNoise(self.t[sl], self.eps[sl])

    def noised(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, t [B, F], σ [B, 1, 1, 1, 1])``"""
        sigma = (self.t / 1000).to(x0.device).view(-1, 1, 1, 1, 1)
        eps = self.eps.to(x0.device, x0.dtype)
        t = self.t.to(x0.device).view(-1, 1).expand(-1, x0.shape[2])
        return (1 - sigma) * x0 + sigma * eps, t, sigma


def score_x0(forward, x0: torch.Tensor, noise: ScoreNoise, embeds: torch.Tensor, neg: torch.Tensor | None = None,
             guidance: float = 1.0) -> torch.Tensor:
    """A score model's x0 prediction of the noised ``x0`` (clean generated context for a causal score)."""
    xt, t, sigma = noise.noised(x0)
    ctx_t = torch.zeros_like(t)
    v = forward(xt, t, embeds, x0, ctx_t).float()
    if guidance != 1.0:
        v_neg = forward(xt, t, neg.expand(x0.shape[0], *neg.shape[1:]), x0, ctx_t).float()
        v = v_neg + guidance * (v - v_neg)
    return xt.float() - sigma * v


def _per_video_mean_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs().mean(dim=tuple(range(1, x.dim())), keepdim=True)


def dmd_gradients(x0_gen: torch.Tensor, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalized DMD gradient on the video and on its temporal differences."""
    gen = x0_gen.detach().float()
    grad = (fake - real) / _per_video_mean_abs(gen - real).clamp_min(1e-8)
    d_real = frame_delta(real)
    grad_motion = (frame_delta(fake) - d_real) / _per_video_mean_abs(frame_delta(gen) - d_real).clamp_min(1e-8)
    return torch.nan_to_num(grad), torch.nan_to_num(grad_motion)


class MotionMatcher(torch.nn.Module):
    """The learnable part of the flow term: a motion head and its EMA copy (the frozen side of the regression)."""

    def __init__(self, channels: int = 16, hidden: int = 64, ema: float = 0.95) -> None:
        super().__init__()
        self.head = MotionHead(channels, hidden)
        self.target = copy.deepcopy(self.head).requires_grad_(False)
        self.decay = ema

    def loss(self, x0_gen: torch.Tensor, dmd_target: torch.Tensor) -> torch.Tensor:
        pred = self.head(frame_delta(x0_gen))
        with torch.no_grad():
            goal = self.target(frame_delta(dmd_target))
        return F.mse_loss(pred, goal)

    @torch.no_grad()
    def update_target(self) -> None:
        for pt, ps in zip(self.target.parameters(), self.head.parameters(), strict=True):
            pt.lerp_(ps, 1 - self.decay)


def generator_loss(x0_gen: torch.Tensor, real: torch.Tensor, fake: torch.Tensor, *, flow_weight: float,
                   motion: MotionMatcher | None, dmd_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``dmd_weight`` × (DMD + ``flow_weight`` × (temporal-difference DMD + motion-head regression)): the flow term's
    weight (the paper's 0.2) is relative to the DMD term."""
    grad, grad_motion = dmd_gradients(x0_gen, real, fake)
    x = x0_gen.float()
    target = (x - grad).detach()
    dmd = 0.5 * F.mse_loss(x, target)
    total = dmd
    parts = {"dmd": float(dmd.detach())}
    if flow_weight > 0:
        dx = frame_delta(x)
        flow = 0.5 * F.mse_loss(dx, (dx - grad_motion).detach())
        head = motion.loss(x, target) if motion is not None else x.new_zeros(())
        total = total + flow_weight * (flow + head)
        parts.update(flow=float(flow.detach()), motion_head=float(head.detach()))
    return dmd_weight * total, parts


def fake_score_loss(forward, x0: torch.Tensor, noise: ScoreNoise, embeds: torch.Tensor) -> torch.Tensor:
    """Flow-matching loss of the fake score on generated videos (target ``ε − x0``)."""
    xt, t, _ = noise.noised(x0)
    v = forward(xt, t, embeds, x0, torch.zeros_like(t)).float()
    return F.mse_loss(v, noise.eps.to(v.device) - x0.float())
