"""``python -m sdvg toy``: train the toy world's models, check its judge, draw a contact sheet."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import ConfigError
from .preset import STAGES, TOY_DIR


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("toy", help="the toy world: train its models (toy train), check its judge, draw sheets")
    sub = p.add_subparsers(dest="toy_command", required=True)
    t = sub.add_parser("train", help="fit the patch latent model, write the text encoder, train target, drafter and "
                       "critic (resumable: rerun the same command to continue)")
    t.add_argument("--out", default=str(TOY_DIR), help=f"models tree to write (default {TOY_DIR}, the committed one)")
    t.add_argument("--work", default=None, help="training states (default: <out>_work beside it; for the committed "
                   "tree ~/.cache/sdvg/toy-train or $SDVG_CACHE_DIR/toy-train)")
    t.add_argument("--stages", default=None, help=f"comma list of {','.join(STAGES)} (default: all)")
    t.add_argument("--max-steps", type=int, default=None, help="cut every training stage to N steps (smoke runs)")
    t.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    t.add_argument("--warm-start", default=None, help="a checkpoints folder (e.g. sdvg/toy/checkpoints): a DiT stage "
                   "with no training state starts from its export there, at its step, with fresh optimiser moments")
    t.set_defaults(func=cmd_train)
    j = sub.add_parser("judge", help="the judge on renders and on noise (it must tell them apart)")
    j.add_argument("--n", type=int, default=24)
    j.set_defaults(func=cmd_judge)
    s = sub.add_parser("sheet", help="a contact sheet PNG: target-only, draft-only and SDVG videos of toy captions")
    s.add_argument("--out", required=True, help="output .png")
    s.add_argument("--captions", type=int, default=4, help="how many toy captions (rows per method)")
    s.add_argument("--tau", type=float, default=None, help="default: TOY_TAU")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--models", default=str(TOY_DIR))
    s.set_defaults(func=cmd_sheet)


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")


def cmd_train(args) -> int:
    from ..devices import set_cpu_threads
    from .train import ToyTrainConfig, train_toy

    stages = tuple(s.strip() for s in args.stages.split(",")) if args.stages else STAGES
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"Unknown --stages {unknown}; choose from {', '.join(STAGES)}.")
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps must be at least 1, got {args.max_steps}.")
    set_cpu_threads(args.threads)
    last = {"t": 0.0}

    def progress(d: dict) -> None:
        now = time.monotonic()
        if now - last["t"] >= 5 or d["step"] == d["steps"]:
            last["t"] = now
            left = (d["steps"] - d["step"]) * d["s_per_step"]
            _log(f"toy {d['role']:8s} step {d['step']:6d}/{d['steps']}  loss {d['loss']:.4f}  "
                 f"{d['s_per_step']:.2f} s/step  ~{left / 60:.0f} min left")

    cfg = ToyTrainConfig().scaled(args.max_steps)
    given = [(flag, value) for flag, value in (("--out", args.out if args.out != str(TOY_DIR) else None),
                                               ("--work", args.work), ("--stages", args.stages),
                                               ("--max-steps", args.max_steps), ("--threads", args.threads),
                                               ("--warm-start", args.warm_start))
             if value is not None]
    command = " ".join(["python -m sdvg toy train", *(f"{f} {v}" for f, v in given)])
    paths = train_toy(args.out, args.work, config=cfg, stages=stages, progress=progress, command=command,
                      warm_start=args.warm_start)
    for role, path in paths.items():
        sys.stdout.write(f"{role:13s} {path}{'' if Path(path).exists() else ' (not trained yet)'}\n")
    return 0


def cmd_judge(args) -> int:
    from .. import ConfigError
    from .judge import validate_judge

    if args.n < 1:
        raise ConfigError(f"--n must be a whole number of clips ≥ 1, got {args.n}.")
    res = validate_judge(args.n)
    sys.stdout.write(f"judge caption accuracy: renders {res['real']:.3f}, uniform noise {res['noise']:.3f}; "
                     f"smoothness: renders {res['real_smooth']:.3f}, noise {res['noise_smooth']:.3f} "
                     f"({args.n} clips each)\n")
    return 0 if res["real"] >= 0.9 and res["noise"] <= 0.3 else 1


def cmd_sheet(args) -> int:
    import math

    from .. import ConfigError
    from ..outputs import OUTPUTS
    from ..outputs.files import check_output_path
    from .preset import TOY_TAU
    from .sheet import contact_sheet

    check_output_path(args.out, "--out", OUTPUTS["timeline"][1])  # a .png, checked before any video is made
    if args.captions < 1:
        raise ConfigError(f"--captions must be a whole number ≥ 1, got {args.captions}.")
    tau = TOY_TAU if args.tau is None else args.tau
    if math.isnan(tau):
        raise ConfigError("--tau NaN is not a threshold; give a number (inf = reject all, -inf = accept all).")
    path = contact_sheet(args.out, models_dir=args.models, n_captions=args.captions, tau=tau, seed=args.seed)
    _log(f"wrote {path}")
    return 0
