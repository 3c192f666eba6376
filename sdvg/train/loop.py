"""``train_diagonal``: the Diagonal Distillation training loop (DMD with diagonal forcing and flow matching).

One iteration: draw the step's data for the *global* batch from the step's own generator (prompts, rollout noise,
exit steps, score noise; each rank keeps its slice, so N processes compute what one process does with the same
global batch), roll the student out, then

- every ``gen_every``-th iteration a generator update: the student's exit-step x0 with autograd, the frozen teacher's
  (real) and the fake score's x0 of the noised video, the DMD + flow loss (``dmd.py``), AdamW, EMA;
- every iteration a fake-score update: flow matching on the rollout's video.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the student and fake score are wrapped in ``DistributedDataParallel`` (gloo
on CPU, NCCL on CUDA); rank 0 writes the checkpoints. State (``<out>/state.pt``: both models, the EMA, the motion
head, optimisers, step, losses) is written every ``save_every`` iterations and at the end; a rerun resumes.
The result is ``<out>/student.pt`` in Self-Forcing's layout (``generator``, ``generator_ema``) and ``train.json``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import resolve_device
from ..errors import ConfigError
from ..loaders.checkpoint import torch_load
from ..sampling.scheduler import FlowMatchScheduler, build_step_schedule
from .config import DiagonalTrainConfig
from .data import load_prompts
from .dmd import MotionMatcher, ScoreNoise, fake_score_loss, generator_loss, score_x0
from .rollout import Rollout, RolloutNoise, TrainForward, draw_exits, rollout, student_x0

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    student: Path
    state: Path
    steps: int
    losses: dict[str, list[float]]
    s_per_iter: float
    peak_memory_mb: float
    interrupted: bool = False  # stopped by ``stop()`` (a signal): the state was saved, a rerun resumes
    resumed_from: int = 0  # the step the run started at (0: a fresh run)


class _Dist:
    """The torchrun environment (one process when ``WORLD_SIZE`` is unset)."""

    def __init__(self, device: torch.device) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.on = self.world > 1
        self.device = device  # collectives run on it: NCCL takes no CPU tensors
        if self.on and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def shard(self, batch: int) -> slice:
        if batch % self.world:
            raise ConfigError(f"batch {batch} does not split over {self.world} processes; use a multiple.")
        n = batch // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        if not self.on or not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return dict(zip(values, (t / self.world).tolist(), strict=True))

    def any(self, flag: bool) -> bool:
        """Whether any rank's ``flag`` is set (every rank gets the same answer); the flag itself in one process."""
        if not self.on:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        torch.distributed.all_reduce(t)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.on:
            torch.distributed.barrier()


def _device(cfg: DiagonalTrainConfig) -> torch.device:
    dev = resolve_device(cfg.device, what="training")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return dev


def model_files(cfg: DiagonalTrainConfig) -> dict[str, str]:
    from ..toy.preset import toy_files

    toy = toy_files()
    teacher = cfg.teacher or str(toy["target"])
    # the student starts as the teacher (Self-Forcing distils a model into itself; the toy recipe that met its goal)
    return {"teacher": teacher, "student": cfg.student_init or teacher, "fake": cfg.fake_init or teacher}


def _load(path: str, dev: torch.device, trainable: bool, cfg: DiagonalTrainConfig):
    from ..loaders.wan import load_dit

    if trainable:  # fp32 master weights; bf16 compute comes from autocast on CUDA
        model = load_dit(path, dtype="fp32", device=dev).train().requires_grad_(True)
        model.gradient_checkpointing = cfg.gradient_checkpointing
        return model
    return load_dit(path, dtype="bf16" if dev.type == "cuda" else "fp32", device=dev).requires_grad_(False)


class _Models:
    def __init__(self, cfg: DiagonalTrainConfig, dev: torch.device, dist: _Dist) -> None:
        files = model_files(cfg)
        self.cfg, self.dev, self.dist = cfg, dev, dist
        self.fsdp = cfg.fsdp and dist.on
        self.teacher = _load(files["teacher"], dev, False, cfg)
        self.student = _load(files["student"], dev, True, cfg)
        self.fake = _load(files["fake"], dev, True, cfg)
        self.ema = copy.deepcopy(self.student).eval().requires_grad_(False)
        self.motion = None
        if cfg.flow_weight > 0 and cfg.motion_head:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                self.motion = MotionMatcher(self.student.config.in_channels, cfg.motion_hidden, cfg.motion_ema).to(dev)

    def finish(self) -> None:
        """Wrap (DDP) or shard (FSDP2) the models and make the optimisers: after the ODE pairs, which rank 0 makes
        alone with the whole teacher."""
        cfg, dist, fpb = self.cfg, self.dist, self.cfg.frames_per_block
        full = cfg.teacher_attention == "full"
        opt = {"betas": cfg.betas, "weight_decay": cfg.weight_decay}
        motion = list(self.motion.head.parameters()) if self.motion else []
        if self.fsdp:
            from . import fsdp

            for model in (self.teacher, self.student, self.fake):
                fsdp.shard(model)
            fsdp.shard(self.ema, methods=False)
            self.student_fwd = TrainForward(self.student, fpb)
            self.fake_fwd = TrainForward(self.fake, fpb, full)
        else:
            self.student_fwd = _wrap(TrainForward(self.student, fpb, companion=self.motion), dist, self.dev)
            self.fake_fwd = _wrap(TrainForward(self.fake, fpb, full), dist, self.dev)
        self.teacher_fwd = TrainForward(self.teacher, fpb, full)
        own = motion if self.fsdp else []  # FSDP: the unsharded motion head gets its own AdamW (same settings)
        self.opt_gen = torch.optim.AdamW([p for p in self.student.parameters()] + (motion if not self.fsdp else []),
                                         lr=cfg.lr, **opt)
        self.opt_motion = torch.optim.AdamW(own, lr=cfg.lr, **opt) if own else None
        self.opt_fake = torch.optim.AdamW(self.fake.parameters(), lr=cfg.lr_fake, **opt)

    @property
    def gen_opts(self) -> list[torch.optim.Optimizer]:
        return [self.opt_gen] + ([self.opt_motion] if self.opt_motion is not None else [])

    def gen_params(self) -> list[torch.nn.Parameter]:
        return [p for o in self.gen_opts for g in o.param_groups for p in g["params"]]

    def clip(self, params) -> None:
        if self.fsdp:
            from . import fsdp

            fsdp.clip_grad_norm_(list(params), self.cfg.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)

    def state(self) -> dict:
        """Every model's and optimiser's full state (under FSDP a collective: call it on every rank)."""
        motion = self.motion.state_dict() if self.motion else None
        if not self.fsdp:
            return {"student": self.student.state_dict(), "fake": self.fake.state_dict(), "ema": self.ema.state_dict(),
                    "motion": motion, "opt_gen": self.opt_gen.state_dict(), "opt_fake": self.opt_fake.state_dict()}
        from . import fsdp

        return {"student": fsdp.full_state(self.student), "fake": fsdp.full_state(self.fake),
                "ema": fsdp.full_state(self.ema), "motion": motion,
                "opt_gen": fsdp.full_optim_state(self.student, self.opt_gen),
                "opt_fake": fsdp.full_optim_state(self.fake, self.opt_fake),
                "opt_motion": self.opt_motion.state_dict() if self.opt_motion else None, "fsdp": True}

    def load(self, st: dict) -> None:
        if bool(st.get("fsdp")) != self.fsdp:
            raise ConfigError("state.pt was saved " + ("with" if st.get("fsdp") else "without") + " FSDP; resume it "
                              "the same way (or start a new --out).")
        if self.motion is not None and st.get("motion") is not None:
            self.motion.load_state_dict(st["motion"])
        if not self.fsdp:
            self.student.load_state_dict(st["student"])
            self.fake.load_state_dict(st["fake"])
            self.ema.load_state_dict(st["ema"])
            self.opt_gen.load_state_dict(st["opt_gen"])
            self.opt_fake.load_state_dict(st["opt_fake"])
            return
        from . import fsdp

        for model, key in ((self.student, "student"), (self.fake, "fake"), (self.ema, "ema")):
            fsdp.load_state(model, st[key])
        fsdp.load_optim_state(self.student, self.opt_gen, st["opt_gen"])
        fsdp.load_optim_state(self.fake, self.opt_fake, st["opt_fake"])
        if self.opt_motion is not None and st.get("opt_motion") is not None:
            self.opt_motion.load_state_dict(st["opt_motion"])


def _wrap(module: torch.nn.Module, dist: _Dist, dev: torch.device) -> torch.nn.Module:
    if not dist.on:
        return module
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None)


@dataclass
class _Step:
    """One iteration's data for this rank."""

    embeds: torch.Tensor
    noise: RolloutNoise
    exits: list[int]
    score: ScoreNoise
    critic: ScoreNoise
    target: torch.Tensor | None  # the teacher's video from the same noise (ODE pairs)
    ode_inputs: torch.Tensor | None  # the teacher's path at each block's exit timestep (ODE pairs)


def _draw(cfg: DiagonalTrainConfig, it: int, bank, schedule, dist: _Dist, channels: int, pairs) -> _Step:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it)
    h, w = cfg.latent_hw
    shape = (cfg.batch, channels, cfg.num_blocks * cfg.frames_per_block, h, w)
    noise = RolloutNoise.draw(gen, shape, schedule, cfg.frames_per_block)
    if pairs is not None:  # the step's videos start from pairs' noise, under the pairs' prompts
        pick = torch.randint(pairs.noise.shape[0], (cfg.batch,), generator=gen)
        idx, noise.initial, target = pairs.prompts[pick], pairs.noise[pick], pairs.x0[pick]
    else:
        idx, target = bank.draw(gen, cfg.batch), None
    exits = draw_exits(gen, schedule)
    ode = pairs.inputs(pick, exits) if pairs is not None else None
    kw = {"min_t": cfg.min_t, "max_t": cfg.max_t, "shift": cfg.score_shift}
    score, critic = ScoreNoise.draw(gen, shape, **kw), ScoreNoise.draw(gen, shape, **kw)
    sl = dist.shard(cfg.batch)
    return _Step(bank(idx[sl]), noise.shard(sl), exits, score.shard(sl), critic.shard(sl),
                 None if target is None else target[sl], None if ode is None else ode[sl])


def _lr_scale(it: int, cfg: DiagonalTrainConfig) -> float:
    """Linear warm-up, then constant (Self-Forcing trains at a constant rate)."""
    return min(1.0, (it + 1) / max(1, cfg.warmup))


class _Trainer:
    def __init__(self, cfg: DiagonalTrainConfig, dev: torch.device, dist: _Dist) -> None:
        self.cfg, self.dev, self.dist = cfg, dev, dist
        self.out = Path(cfg.out)
        self.bank = load_prompts(cfg.data, cfg.text_encoder, self.out)
        self.m = _Models(cfg, dev, dist)
        self.scheduler = FlowMatchScheduler(cfg.shift)
        self.schedule = build_step_schedule(cfg.schedule, cfg.num_blocks, self.scheduler)
        self.neg = self.bank.negative.float().to(dev)
        self.autocast = cfg.autocast == "bf16" or (cfg.autocast == "auto" and dev.type == "cuda")
        self.pairs = None
        if cfg.regression_weight > 0:  # rank 0 makes (or loads) and writes them, the others then load its file
            from .ode_pairs import make_pairs

            for turn in (True, False):
                if (dist.rank == 0) == turn:
                    self.pairs = make_pairs(self.m.teacher, self.bank, cfg, model_files(cfg)["teacher"], self.out,
                                            self.schedule)
                dist.barrier()
        self.m.finish()
        self.step, self.losses = 0, {}
        self.timing = {"seconds": 0.0, "iterations": 0, "peak_memory_mb": 0.0}  # over every session of the run

    def amp(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.dev.type, dtype=torch.bfloat16)

    def iteration(self, it: int) -> dict[str, float]:
        cfg, m = self.cfg, self.m
        s = _draw(cfg, it, self.bank, self.schedule, self.dist, m.student.config.in_channels, self.pairs)
        embeds = s.embeds.to(self.dev)
        for opt in (*m.gen_opts, m.opt_fake):
            for g in opt.param_groups:
                g["lr"] = (cfg.lr_fake if opt is m.opt_fake else cfg.lr) * _lr_scale(it, cfg)
        if cfg.dmd_weight == 0 and s.target is not None:  # the ODE-initialisation stage: regression only
            return self._regression_update(embeds, s)
        with self.amp():
            roll = rollout(m.student, embeds, s.noise, self.schedule, s.exits, cache=cfg.cache,
                           scheduler=self.scheduler, fpb=cfg.frames_per_block, step_noise=cfg.step_noise)
        logs = self._generator_update(roll, embeds, s) if it % cfg.gen_every == 0 else {}
        logs["fake"] = self._fake_update(roll.x0, embeds, s.critic)
        return logs

    def _ode_rollout(self, s: _Step) -> Rollout:
        """The teacher's path states at each block's exit timestep, as a rollout whose video is the teacher's."""
        t_exit = [row[k] for row, k in zip(self.schedule, s.exits, strict=True)]
        return Rollout.of(s.ode_inputs.to(self.dev), t_exit, s.target.to(self.dev), self.scheduler,
                          self.cfg.frames_per_block)

    def _regression_update(self, embeds: torch.Tensor, s: _Step) -> dict[str, float]:
        """CausVid's / Self-Forcing's ODE initialisation: the student's x0 from the teacher's path states regressed
        onto the teacher's video; no rollout, no scores, no fake-score update (``dmd_weight`` 0)."""
        with self.amp():
            x0 = student_x0(self.m.student_fwd, self._ode_rollout(s), embeds, self.cfg.cache)
            reg = torch.nn.functional.mse_loss(x0, s.target.to(x0.device))
        self._step_generator(self.cfg.regression_weight * reg)
        return {"gen": float(reg.detach()) * self.cfg.regression_weight, "regression": float(reg.detach())}

    def _student_forward(self, roll: Rollout, embeds: torch.Tensor, s: _Step):
        """The student's exit-step x0 of its rollout and (ODE pairs) of the teacher's path states: one forward."""
        if s.target is None:
            return student_x0(self.m.student_fwd, roll, embeds, self.cfg.cache), None
        ode = self._ode_rollout(s)
        both = student_x0(self.m.student_fwd, roll.cat(ode), torch.cat([embeds, embeds]), self.cfg.cache)
        n = roll.x_exit.shape[0]
        return both[:n], both[n:]

    def _generator_update(self, roll, embeds, s: _Step) -> dict[str, float]:
        cfg, m = self.cfg, self.m
        with self.amp():
            x0, x0_ode = self._student_forward(roll, embeds, s)
            with torch.no_grad():
                real = score_x0(m.teacher_fwd, x0.detach(), s.score, embeds, self.neg, cfg.real_guidance)
                fake = score_x0(_module(m.fake_fwd), x0.detach(), s.score, embeds)
            loss, parts = generator_loss(x0, real, fake, flow_weight=cfg.flow_weight, motion=m.motion,
                                         dmd_weight=cfg.dmd_weight)
            if x0_ode is not None:
                reg = torch.nn.functional.mse_loss(x0_ode, s.target.to(x0.device))
                loss = loss + cfg.regression_weight * reg
                parts["regression"] = float(reg.detach())
        self._step_generator(loss)
        return {"gen": float(loss.detach()), **parts}

    def _step_generator(self, loss: torch.Tensor) -> None:
        """Backward, clip, AdamW, then the EMA and the motion head's target."""
        cfg, m = self.cfg, self.m
        for opt in m.gen_opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        if m.fsdp and m.motion is not None:
            from .fsdp import average_grads

            average_grads(m.motion.head, self.dist.world)
        m.clip(m.gen_params())
        for opt in m.gen_opts:
            opt.step()
        with torch.no_grad():
            for pe, ps in zip(m.ema.parameters(), m.student.parameters(), strict=True):
                pe.lerp_(ps, 1 - cfg.ema)
        if m.motion is not None:
            m.motion.update_target()

    def _fake_update(self, x0: torch.Tensor, embeds: torch.Tensor, noise: ScoreNoise) -> float:
        m = self.m
        with self.amp():
            loss = fake_score_loss(m.fake_fwd, x0.float(), noise, embeds)
        m.opt_fake.zero_grad(set_to_none=True)
        loss.backward()
        m.clip(m.fake.parameters())
        m.opt_fake.step()
        return float(loss.detach())

    # ------------------------------------------------------------------ state
    @property
    def state_path(self) -> Path:
        return self.out / "state.pt"

    def resume(self) -> None:
        if self.state_path.is_file():
            st = torch_load(self.state_path)
            self.m.load(st)
            self.step, self.losses = int(st["step"]), {k: list(v) for k, v in st["losses"].items()}
            self.timing.update(st.get("timing", {}))
            logger.info("resuming Diagonal Distillation at step %d", self.step)
        self.saved_at = time.monotonic()

    def due(self) -> bool:
        """Whether to save now: every ``save_every`` iterations or ``save_every_minutes``, and at the last step."""
        cfg = self.cfg
        minutes = cfg.save_every_minutes > 0 and time.monotonic() - self.saved_at >= 60 * cfg.save_every_minutes
        minutes = self.dist.any(minutes)  # every rank must agree (the save has a barrier)
        return self.step % cfg.save_every == 0 or self.step == cfg.steps or minutes

    def save(self) -> None:
        st = self.m.state()  # every rank (a collective under FSDP)
        if self.dist.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            self.timing["peak_memory_mb"] = max(self.timing["peak_memory_mb"], peak_memory_mb(self.dev))
            torch.save({**st, "step": self.step, "losses": self.losses, "config": self.cfg.to_json(),
                        "timing": self.timing},
                       tmp)
            tmp.replace(self.state_path)
            self._write_student(st)
        self.saved_at = time.monotonic()
        self.dist.barrier()

    def record(self, logs: dict[str, float]) -> None:
        for k, v in logs.items():  # [iteration, value]: the generator's terms are logged on its iterations only
            self.losses.setdefault(k, []).append([self.step, v])

    def _write_student(self, st: dict) -> Path:
        """``student.pt`` in Self-Forcing's layout from a full state (rank 0; rewritten at every save)."""
        from ..fixtures.tiny import write_self_forcing_pt
        from ..loaders.wan_keys import to_original_keys

        return write_self_forcing_pt(self.out / "student.pt", to_original_keys(st["student"]), to_original_keys(st["ema"]),
                                     self.m.student.config.num_attention_heads)

    @property
    def s_per_iter(self) -> float:
        return self.timing["seconds"] / max(1, self.timing["iterations"])

    def peak_mb(self) -> float:
        return max(self.timing["peak_memory_mb"], peak_memory_mb(self.dev))

    def export(self) -> Path:
        path = self.out / "student.pt"
        st = self.m.state()  # every rank (a collective under FSDP)
        measured = {}
        if self.m.fsdp:  # what FSDP2 holds per rank, beside memory_plan's estimate (a collective)
            from .fsdp import shard_bytes

            measured = {"fsdp_bytes_per_rank": shard_bytes(self.m, self.dist.world)}
        if self.dist.rank == 0:
            self._write_student(st)
            info = {**measured, "command": "python -m sdvg train diagonal", "config": self.cfg.to_json(), "steps": self.step,
                    "world_size": self.dist.world, "s_per_iter": self.s_per_iter, "peak_memory_mb": self.peak_mb(),
                    "schedule": self.schedule, "losses": self.losses}
            (self.out / "train.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        self.dist.barrier()
        return path


def _module(m: torch.nn.Module) -> torch.nn.Module:
    return getattr(m, "module", m)


def peak_memory_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _stop_now(stop: Callable[[], bool] | None, dist: _Dist) -> bool:
    """Whether ``stop()`` asks to end the run; under torchrun any rank's signal stops every rank at the same step."""
    return dist.any(bool(stop is not None and stop()))


def train_diagonal(cfg: DiagonalTrainConfig, *, progress: Callable[[dict], None] | None = None,
                   notify: Callable[[str], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> TrainResult:
    """Train (or resume) a Diagonal Distillation student; see the module docstring.

    ``notify`` gets one-line messages for the user (resuming, stopping); ``stop()`` is asked after every iteration
    (the CLI's signal handler): when it says yes the state is saved and the result says ``interrupted``."""
    cfg.validate()
    say = notify if notify is not None else logger.info
    dev = _device(cfg)
    dist = _Dist(dev)
    tr = _Trainer(cfg, dev, dist)
    tr.resume()
    start = tr.step
    if start and dist.rank == 0:
        say(f"resuming from step {start} of {cfg.steps} ({tr.state_path})" if start < cfg.steps else
            f"already trained to step {start} ({tr.state_path}); --max-steps more than {start} trains on")
    interrupted = False
    while tr.step < cfg.steps:
        t0 = time.perf_counter()
        logs = dist.mean(tr.iteration(tr.step))
        tr.timing["seconds"] += time.perf_counter() - t0
        tr.timing["iterations"] += 1
        tr.step += 1
        tr.record(logs)
        if progress is not None and dist.rank == 0:
            progress({"step": tr.step, "steps": cfg.steps, **logs, "s_per_iter": tr.s_per_iter})
        interrupted = _stop_now(stop, dist)
        if interrupted or tr.due():
            tr.save()
        if interrupted:
            if dist.rank == 0:
                say(f"stopped at step {tr.step} of {cfg.steps}; state saved to {tr.state_path} "
                    "(rerun the same command to resume)")
            break
    student = tr.export()
    return TrainResult(student, tr.state_path, tr.step, tr.losses, tr.s_per_iter, tr.peak_mb(), interrupted, start)
