"""``python -m sdvg train diagonal``: Diagonal Distillation training (resumable; ``torchrun`` for several
processes), or with ``--dry-run`` the FSDP memory plan per GPU without loading anything."""

from __future__ import annotations

import json
import sys
import time

from ..errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train: Diagonal Distillation of a few-step streaming student")
    sub = p.add_subparsers(dest="train_command", required=True)
    d = sub.add_parser("diagonal", help="DMD with diagonal forcing and flow distribution matching (defaults: the toy "
                       "world; rerun the same command to resume; run under torchrun for several processes)")
    d.add_argument("--config", help="JSON file of hyper-parameters (sdvg/train/config.py lists every key)")
    d.add_argument("--teacher", help="the real score (default: the toy target)")
    d.add_argument("--student-init", help="the student's initial weights (default: the toy drafter)")
    d.add_argument("--fake-init", help="the fake score's initial weights (default: the teacher's)")
    d.add_argument("--data", help="toy (default) | prompt .txt file or folder (needs --text-encoder) | embedding .pt")
    d.add_argument("--text-encoder", help="text encoder file for a prompt file or folder")
    d.add_argument("--out", help="output folder: student.pt, state.pt, train.json (default out/diagonal)")
    d.add_argument("--max-steps", type=int, help="total training iterations (overrides the config's steps)")
    d.add_argument("--batch", type=int, help="global batch (split over the processes)")
    d.add_argument("--schedule", help="diagonal (default) | constant | JSON per-block lists")
    d.add_argument("--cache", choices=["noisy", "clean"], help="noisy = diagonal forcing (default); clean = "
                   "Self-Forcing's clean re-run (ablation)")
    d.add_argument("--flow-weight", type=float, help="weight of the flow distribution-matching term (default 0.2; "
                   "0 = off)")
    d.add_argument("--seed", type=int)
    d.add_argument("--save-every", type=int, help="iterations between saves of state.pt (default 100)")
    d.add_argument("--save-every-minutes", type=float, help="... or minutes, whichever comes first (default 10; "
                   "0 = iterations only)")
    d.add_argument("--device", help="cpu (default) | cuda | cuda:N (under torchrun: each rank's LOCAL_RANK)")
    d.add_argument("--gradient-checkpointing", action="store_true", default=None)
    d.add_argument("--fsdp", action="store_true", default=None, help="under torchrun: shard student, teacher, fake "
                   "score and EMA with FSDP2 (fully_shard) instead of DDP")
    d.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    d.add_argument("--dry-run", action="store_true", help="print the FSDP memory plan per GPU and exit")
    d.add_argument("--plan-model", choices=["1.3b", "student"], default="student", help="--dry-run: plan the "
                   "student's own shape (read from its header) or the real Self-Forcing 1.3B")
    d.add_argument("--gpus", default="1,2,4,8", help="--dry-run: GPU counts to plan for")
    d.set_defaults(func=cmd_diagonal)


def _config(args):
    from .config import load_config

    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps must be at least 1, got {args.max_steps}.")
    schedule = args.schedule
    if schedule is not None and schedule.strip().startswith("["):
        try:
            schedule = json.loads(schedule)
        except ValueError as exc:
            raise ConfigError(f"--schedule {args.schedule!r} is not valid JSON: {exc}.") from None
    return load_config(args.config, teacher=args.teacher, student_init=args.student_init, fake_init=args.fake_init,
                       data=args.data, text_encoder=args.text_encoder, out=args.out, steps=args.max_steps,
                       batch=args.batch, schedule=schedule, cache=args.cache, flow_weight=args.flow_weight,
                       seed=args.seed, device=args.device, gradient_checkpointing=args.gradient_checkpointing,
                       save_every=args.save_every, fsdp=args.fsdp, save_every_minutes=args.save_every_minutes)


def _check_files(cfg) -> None:
    """Name every missing model file before anything loads."""
    from pathlib import Path

    missing = [f"{k} {v}" for k, v in (("teacher", cfg.teacher), ("student-init", cfg.student_init),
                                      ("fake-init", cfg.fake_init), ("text-encoder", cfg.text_encoder))
               if v is not None and not Path(v).exists()]
    if missing:
        raise ConfigError("Missing file(s): " + ", ".join(missing) + ".")


def _dry_run(cfg, args) -> int:
    from ..loaders.wan import inspect_dit_checkpoint
    from .loop import model_files
    from .plan import WAN_1P3B, format_plan, memory_plan

    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(f"--gpus {args.gpus!r}: give GPU counts like 1,2,4,8.") from None
    if args.plan_model == "1.3b":
        config, frames, hw = WAN_1P3B, 21, (60, 104)
    else:
        config = inspect_dit_checkpoint(model_files(cfg)["student"]).config
        frames, hw = cfg.num_blocks * cfg.frames_per_block, cfg.latent_hw
    per_gpu = max(1, cfg.batch // max(gpus)) if args.plan_model == "student" else 1
    plans = [memory_plan(config=config, gpus=g, batch_per_gpu=per_gpu, num_frames=frames, latent_hw=hw,
                         gradient_checkpointing=cfg.gradient_checkpointing or args.plan_model == "1.3b")
             for g in gpus]
    sys.stdout.write(format_plan(plans) + "\n")
    return 0


class _Bar:
    """A one-line progress bar with the latest losses (stderr; a new line every 5 s when not a terminal)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.gen: dict[str, float] = {}

    def __call__(self, d: dict) -> None:
        self.gen.update({k: d[k] for k in ("dmd", "flow") if k in d})
        now = time.monotonic()
        done = d["step"] == d["steps"]
        if not self.tty and now - self.last < 5 and not done:
            return
        self.last = now
        frac = d["step"] / d["steps"]
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        losses = "  ".join(f"{k} {v:.4f}" for k, v in {**self.gen, "fake": d["fake"]}.items())
        left = (d["steps"] - d["step"]) * d["s_per_iter"] / 60
        line = f"[{bar}] {d['step']}/{d['steps']}  {losses}  {d['s_per_iter']:.2f} s/it  ~{left:.0f} min left"
        sys.stderr.write(("\r" + line + ("\n" if done else "")) if self.tty else line + "\n")
        sys.stderr.flush()


def cmd_diagonal(args) -> int:
    from ..devices import set_cpu_threads

    cfg = _config(args)
    if args.dry_run:
        return _dry_run(cfg, args)
    _check_files(cfg)
    set_cpu_threads(args.threads)
    from ..stop import StopSignals
    from .loop import train_diagonal

    def say(message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    with StopSignals(say) as signals:  # the first Ctrl-C / SIGTERM: save after this iteration, exit 130 / 143
        res = train_diagonal(cfg, progress=_Bar(), notify=say, stop=signals.requested)
    sys.stdout.write(f"student    {res.student}\nsteps      {res.steps}\ns/iter     {res.s_per_iter:.3f}\n"
                     f"peak MiB   {res.peak_memory_mb:.0f}\n")
    return signals.exit_code if res.interrupted else 0
