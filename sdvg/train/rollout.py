"""The student's self-forcing rollout on its own few-step schedule, and its gradient forward.

A rollout runs the project's cached sampler path (``forward_block`` with a :class:`SelfKVCache`, the same code the
sampler uses) block by block from pure noise with fresh noise between steps. Each block stops at its *exit step*
(drawn per block, as Self-Forcing trains every step of its list); the block's x0 at that step is the generated block.
What the cache keeps of a finished block is the training choice:

- ``noisy`` (diagonal forcing): the K/V of the block's last noisy step (the exit step's input) — no clean re-run,
  exactly what the noisy-cache sampler keeps;
- ``clean`` (Self-Forcing): the block's x0 re-run at t = 0.

The gradient forward then recomputes every block's exit-step prediction in *one* forward with autograd: for the noisy
cache that is ``forward_train`` over the exit inputs (block-causal mask: each block sees the earlier blocks' exit
inputs, i.e. their noisy cache), for the clean cache ``forward_with_context`` with the rollout's x0 as context. Both
equal the cached rollout's predictions (tests/test_train_diagonal.py); gradients flow through the exit step only, as
in Self-Forcing (the inputs are the rollout's, detached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.dit import CausalWanTransformer
from ..sampling.scheduler import FlowMatchScheduler, renoise, to_eps, to_x0


@dataclass
class RolloutNoise:
    """A rollout's noise: each block's initial noise and its re-noise tensors (``renoise[b][i]`` before step i+1)."""

    initial: torch.Tensor  # [B, C, F, h, w]
    renoise: list[list[torch.Tensor]]  # per block, [B, C, fpb, h, w] each

    @staticmethod
    def draw(gen: torch.Generator, shape: tuple[int, ...], schedule: list[list[float]], fpb: int) -> RolloutNoise:
        initial = torch.randn(shape, generator=gen)
        block = (*shape[:2], fpb, *shape[3:])
        renoise = [[torch.randn(block, generator=gen) for _ in row[:-1]] for row in schedule]
        return RolloutNoise(initial, renoise)

    def shard(self, sl: slice) -> RolloutNoise:
        return RolloutNoise(self.initial[sl], [[r[sl] for r in row] for row in self.renoise])


@dataclass
class Rollout:
    x_exit: torch.Tensor  # [B, C, F, h, w]: each block's input at its exit step
    t_exit: torch.Tensor  # [B, F]: the exit step's timestep, per frame
    sigma_exit: torch.Tensor  # [B, 1, F, 1, 1]
    x0: torch.Tensor  # [B, C, F, h, w]: the generated video (no grad)
    exits: list[int]
    states: list[list[torch.Tensor]] | None = None  # with record=True: each block's input before each of its steps

    @staticmethod
    def of(x_exit: torch.Tensor, t_blocks: list[float], x0: torch.Tensor, scheduler: FlowMatchScheduler,
           fpb: int = 3) -> Rollout:
        """A rollout made of given exit inputs (the teacher's ODE states) at per-block timesteps."""
        b, f = x_exit.shape[0], x_exit.shape[2]
        t = torch.tensor([tb for tb in t_blocks for _ in range(fpb)], device=x_exit.device)
        sig = torch.tensor([scheduler.step_sigma(tb) for tb in t_blocks for _ in range(fpb)], device=x_exit.device)
        return Rollout(x_exit, t.expand(b, f).clone(), sig.view(1, 1, f, 1, 1).expand(b, 1, f, 1, 1).clone(), x0, [])

    def cat(self, other: Rollout) -> Rollout:
        """Both rollouts as one batch (one forward, as DDP wants one forward per backward)."""
        return Rollout(*(torch.cat([a, b.to(a.device, a.dtype)]) for a, b in
                         ((self.x_exit, other.x_exit), (self.t_exit, other.t_exit),
                          (self.sigma_exit, other.sigma_exit), (self.x0, other.x0))), self.exits)


def draw_exits(gen: torch.Generator, schedule: list[list[float]]) -> list[int]:
    """One exit step per block, uniform over that block's steps (shared across the batch)."""
    return [int(torch.randint(len(row), (), generator=gen)) for row in schedule]


def rollout(model: CausalWanTransformer, embeds: torch.Tensor, noise: RolloutNoise, schedule: list[list[float]],
            exits: list[int], *, cache: str, scheduler: FlowMatchScheduler, fpb: int = 3,
            step_noise: str = "fresh", record: bool = False) -> Rollout:
    """Roll the student out block by block (no autograd) on the cached sampler path; between steps re-noise with
    the rollout's fresh noise or (``step_noise="predicted"``) the noise the student predicts, as the sampler does."""
    init = noise.initial
    b, _, f, h, w = init.shape
    dev, dt = model.execution_device, model.compute_dtype
    with torch.no_grad():  # not inference mode: FSDP2's gathered parameters must stay ordinary tensors
        cross = model.prepare_cross_attention(embeds.to(dev))
        kv = model.new_kv_cache(batch=b, latent_hw=(h, w), capacity_frames=f)
        xs, x0s, ts, states = [], [], [], []
        for blk, (row, k) in enumerate(zip(schedule, exits, strict=True)):
            frame = blk * fpb
            x = init[:, :, frame:frame + fpb].to(dev, dt)
            states.append([])
            for i in range(k + 1):
                if record:
                    states[-1].append(x.clone())
                sigma = scheduler.step_sigma(row[i])
                v = model.forward_block(x, torch.full((b, fpb), float(row[i]), device=dev), kv, cross,
                                        frame_offset=frame)
                x0 = to_x0(x, v, sigma)
                if i < k:
                    eps = to_eps(x, v, sigma) if step_noise == "predicted" else noise.renoise[blk][i].to(dev, dt)
                    x = renoise(x0, eps, scheduler.step_sigma(row[i + 1]))
            if cache == "clean":
                model.forward_block(x0, torch.zeros(b, fpb, device=dev), kv, cross, frame_offset=frame)
            xs.append(x)
            x0s.append(x0)
            ts.append(row[k])
    t_exit = torch.tensor([t for t in ts for _ in range(fpb)], device=dev).expand(b, f).clone()
    sig = torch.tensor([scheduler.step_sigma(t) for t in ts for _ in range(fpb)], device=dev)
    return Rollout(torch.cat(xs, 2).clone(), t_exit, sig.view(1, 1, f, 1, 1).expand(b, 1, f, 1, 1).clone(),
                   torch.cat(x0s, 2).clone(), list(exits),
                   [[x.clone() for x in row] for row in states] if record else None)


ForwardFn = Callable[..., torch.Tensor]


def student_x0(forward: ForwardFn, roll: Rollout, embeds: torch.Tensor, cache: str) -> torch.Tensor:
    """Every block's exit-step x0 prediction, with autograd, in one forward (see the module docstring).

    ``forward(x, t, embeds, ctx=None, t_ctx=None)`` is :class:`TrainForward` (or its DDP wrapper)."""
    if cache == "noisy":
        v = forward(roll.x_exit, roll.t_exit, embeds)
    else:
        v = forward(roll.x_exit, roll.t_exit, embeds, roll.x0, torch.zeros_like(roll.t_exit))
    return roll.x_exit.float() - roll.sigma_exit * v.float()


class TrainForward(torch.nn.Module):
    """A DiT's training forward as ``forward()``, so ``DistributedDataParallel`` sees (and syncs) it: cross-attention
    from the text embeddings, then ``forward_train`` (one sequence) or ``forward_with_context``."""

    def __init__(self, model: CausalWanTransformer, fpb: int = 3, full: bool = False,
                 companion: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.fpb = fpb
        self.full = full  # bidirectional: one block of all frames
        # trained by the same loss outside forward() (the motion head): inside the wrapper, DDP broadcasts its initial
        # weights and averages its gradients with the model's
        self.companion = companion

    def forward(self, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, ctx: torch.Tensor | None = None,
                t_ctx: torch.Tensor | None = None) -> torch.Tensor:
        cross = self.model.cross_attention(embeds)
        if ctx is None or self.full:
            return self.model.forward_train(x, t, cross, x.shape[2] if self.full else self.fpb)
        return self.model.forward_with_context(ctx, t_ctx, x, t, cross, self.fpb)
