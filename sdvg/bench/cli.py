"""``python -m sdvg bench``: the bench's command line (tiny profile on the CPU, real-size profile on a GPU)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace

import torch

from ..devices import resolve_device, set_cpu_threads
from ..errors import ConfigError
from ..jsonable import to_jsonable
from ..outputs.files import plan_outputs, write_atomic
from ..sampling.compat import add_compat_args, compat_from_args
from .real_size import REAL_HEIGHT, REAL_SIZE_NOTES, REAL_WIDTH, format_plan, memory_plan
from .report import SCHEMA, format_table, render_plot
from .runner import BenchSettings, run_bench, run_once
from .variants import Variant, default_variants, select


def _parse_levels(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) / (100.0 if float(x) > 1 else 1.0) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--levels must be numbers (0-1 or percent), got {text!r}.") from exc
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise ConfigError(f"--levels must be in [0, 1] (or 0-100 %), got {text!r}.")
    return vals


def add_parser(subparsers) -> None:
    from . import __doc__ as bench_doc

    p = subparsers.add_parser(
        "bench", help="speed benchmark: target-only, draft-only, forced acceptance sweep, variants, cost-model bound",
        description=bench_doc.split("\n\n")[0],
    )
    p.add_argument("--profile", choices=["tiny", "paper-ratio", "real-size"], default="tiny",
                   help="tiny: the tiny preset on the CPU (default); paper-ratio: CPU DiTs sized so a target forward "
                        "costs ~10 drafter forwards and decode/score are small next to it, as at real size "
                        "(sdvg/fixtures/paper_ratio.py); real-size: random weights at the real 1.3B/14B, "
                        "VAE and ImageReward shapes, 832×480, bf16, on a GPU")
    p.add_argument("--device", default=None, help="tiny: cpu (default); real-size: cuda (default)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per video (tiny 9, real-size 5: 8 / 4 drafted "
                   "blocks make 0/25/50/75/100 %% exact)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes over all rows (tiny 5, real-size 1)")
    p.add_argument("--interleave", type=int, default=None, help="rows per interleaved group: each group runs beside "
                   "its own target-only run, one block of each in turn, for a paired speedup (tiny 2; real-size 0 = "
                   "every run on its own)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per row before the timed ones (tiny 1, "
                   "real-size 0; real-size always does one global warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (tiny default 1: on small CPUs "
                   "more threads oversubscribe the cores for these tiny ops)")
    p.add_argument("--levels", default="0,25,50,75,100", help="forced acceptance levels in %% (default 0,25,50,75,100)")
    p.add_argument("--only", default="", help="comma list of row groups or names to run (baseline, random, scored, "
                   "pipelined, refine, noisy, diagonal, global); target-only always runs")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default=None, help="tiny profile: a make-tiny folder (default: the cached preset)")
    p.add_argument("--json", default=None, help="write the full report JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of speedup vs acceptance with the bound")
    p.add_argument("--dry-run", action="store_true", help="real-size: build everything on the meta device and print "
                   "the memory plan (params, KV bytes, VAE cache bytes); runs nothing")
    p.add_argument("--card-gib", type=float, default=24.0, help="real-size --dry-run: also plan the 14B + 1.3B fit on a "
                   "card of this many GiB with fp8 weights and target-block offload (default 24)")
    p.add_argument("--card-target", choices=("fp8_e4m3fn", "Q8_0", "Q6_K", "Q5_K", "Q4_K"), default="fp8_e4m3fn",
                   help="real-size --dry-run: the target in the card plan: SDVG's fp8 storage or a GGUF file of that type")
    p.add_argument("--card-drafter-dtype", choices=("fp8_e4m3fn", "bf16"), default="fp8_e4m3fn",
                   help="real-size --dry-run: the drafter's dtype in the card plan (bf16: the 24 GB recipe of the README, "
                        "--target-dtype fp8_e4m3fn --drafter-dtype bf16)")
    add_compat_args(p, profile_flag="--compat")
    p.set_defaults(func=cmd_bench)


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # CLI output of the command


def settings_from_args(args) -> BenchSettings:
    from ..fixtures.paper_ratio import PAPER_RATIO_WIDTH

    real = args.profile == "real-size"
    small = PAPER_RATIO_WIDTH if args.profile == "paper-ratio" else 64
    s = BenchSettings(
        profile=args.profile,
        blocks=args.blocks if args.blocks is not None else (5 if real else 9),
        width=args.width if args.width is not None else (REAL_WIDTH if real else small),
        height=args.height if args.height is not None else (REAL_HEIGHT if real else small),
        seed=args.seed,
        repeats=args.repeats if args.repeats is not None else (1 if real else 5),
        interleave=args.interleave,
        warmup=args.warmup if args.warmup is not None else (0 if real else 1),
        levels=_parse_levels(args.levels),
        only=tuple(x.strip() for x in args.only.split(",") if x.strip()),
        compat=compat_from_args(args),
    )
    for option, value, least in (("--repeats", s.repeats, 1), ("--warmup", s.warmup, 0),
                                 ("--interleave", s.groups_of, 0), ("--blocks", s.blocks, 2)):
        if value < least:
            why = " (block 0 is always the target's: a bench needs a drafted block)" if option == "--blocks" else ""
            raise ConfigError(f"{option} must be at least {least}{why}, got {value}.")
    return s


def cmd_bench(args) -> int:
    s = settings_from_args(args)
    select(default_variants(s.profile, s.levels), s.only)  # a misspelt --only fails before anything loads
    plan_outputs({"bench_json": args.json, "bench_plot": args.plot})  # and so does an output that cannot be written
    if args.profile == "real-size":
        return _cmd_real_size(args, s)
    return _cmd_tiny(args, s)


def _emit(report: dict, args) -> None:
    sys.stdout.write(format_table(report) + "\n")  # CLI output of the command
    if args.json:
        _write_json(report, args.json)
    if args.plot:
        _log(f"wrote {render_plot(report, args.plot)}")


def _write_json(data: dict, path: str) -> None:
    text = json.dumps(to_jsonable(data), indent=2, allow_nan=False, default=_json_default) + "\n"
    _log(f"wrote {write_atomic(path, lambda tmp: tmp.write_text(text, encoding='utf-8'))}")


def _partial_writer(path: str | None, head: dict):
    """A ``run_bench`` progress callback that rewrites ``path`` with every timed run so far (``"partial": true``), so
    a bench killed mid-way keeps what it measured; the finished report replaces it."""
    if not path:
        return None
    done: dict[str, list[dict]] = {}

    def progress(name: str, m, cuda_peaks) -> None:
        done.setdefault(name, []).append({"wall_s": m.wall, "busy_s": m.busy, "segments_s": m.segments,
                                          "call_s": m.call_seconds, "calls": m.counts, "decisions": m.decisions,
                                          "cuda_peak_bytes": max(cuda_peaks) if cuda_peaks else None})
        text = json.dumps(to_jsonable({**head, "partial": True, "runs_done": done}), default=_json_default)
        write_atomic(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))

    return progress


def _json_default(obj):
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    raise TypeError(f"not JSON-serializable: {type(obj).__name__}")


def _cmd_tiny(args, s: BenchSettings) -> int:
    from ..fixtures.paper_ratio import ensure_paper_ratio
    from ..fixtures.tiny import ensure_tiny
    from ..loaders.bundle import load_models

    device = resolve_device(args.device or "cpu", what="bench models")
    s.threads = set_cpu_threads(args.threads, 1 if device.type == "cpu" else None)
    models_dir = args.models
    if models_dir is None:
        ensure = ensure_paper_ratio if s.profile == "paper-ratio" else ensure_tiny
        models_dir, created = ensure()
        _log(f"{s.profile} preset: {models_dir} ({'created' if created else 'cached'})")
    models = load_models(models_dir, dit_device=str(device), aux_device=str(device),
                         dtype="fp32" if device.type == "cpu" else "auto", pt_weights=s.compat.pt_weights)
    embeds = models.text_encoder.encode(s.prompt)
    _log(f"bench: {s.profile} profile on {device}, {s.blocks} blocks at {s.width}x{s.height}, {s.warmup} warm-up + "
         f"{s.repeats} timed run(s) per row, {s.threads} thread(s)")
    progress = _partial_writer(args.json, {"schema": SCHEMA, "settings": asdict(s)})
    _emit(run_bench(models, s, device=device, embeds=embeds, log=_log, progress=progress), args)
    return 0


def _dry_run(args, s: BenchSettings) -> int:
    from ..fixtures.random_models import RealSizeSpec, build_real_size_models
    from .card_plan import card_plan, check_positive, format_card_plan

    card = check_positive(args.card_gib)
    models = build_real_size_models(torch.device("meta"), RealSizeSpec())
    plan = memory_plan(models, s)
    plan["card_plan"] = card_plan(models, plan, card_bytes=card, drafter_dtype=args.card_drafter_dtype,
                                  target=args.card_target)
    sys.stdout.write(format_plan(plan) + "\n" + format_card_plan(plan["card_plan"]) + "\n")  # CLI output
    variants = select(default_variants("real-size", s.levels), s.only)
    sys.stdout.write(f"rows ({len(variants)}): " + ", ".join(v.name for v in variants) + "\n")  # CLI output
    if args.json:
        _write_json({"schema": SCHEMA, "dry_run": True, "settings": asdict(s), "memory_plan": plan,
                     "rows": [asdict(v) for v in variants]}, args.json)
    return 0


def _cmd_real_size(args, s: BenchSettings) -> int:
    from ..fixtures.random_models import RealSizeSpec, build_real_size_models

    if args.dry_run:
        return _dry_run(args, s)
    device = resolve_device(args.device or "auto", what="real-size bench")
    if device.type != "cuda":
        raise ConfigError(
            "The real-size profile needs a CUDA GPU (two bf16 DiTs of 1.3B and 14B parameters at 832×480; about "
            "45 GB). This machine has none. Use `--profile real-size --dry-run` to print the memory plan on the CPU, "
            "or `--profile tiny` to benchmark here."
        )
    s.threads = set_cpu_threads(args.threads)
    spec = RealSizeSpec()
    t0 = time.perf_counter()
    models = build_real_size_models(device, spec)
    build_s = time.perf_counter() - t0
    _log(f"built random real-size models on {device} in {build_s:.1f}s")
    gen = torch.Generator(device=device).manual_seed(0)
    embeds = torch.randn((1, spec.text_len, spec.text_dim), device=device, dtype=spec.dtype, generator=gen)
    plan = memory_plan(models, s)
    # one global warm-up: a scored 2-block run touches every model, kernel and allocator path
    warm = replace(s, blocks=2, repeats=1, warmup=0)
    run_once(models, Variant("warm-up", "scored", 0.0), warm, embeds, (False,), device)
    _log(f"warm-up done ({time.perf_counter() - t0:.1f}s since start)")
    extra = {"real_size": {"memory_plan": plan, "build_s": build_s, "approximations": REAL_SIZE_NOTES}}
    progress = _partial_writer(args.json, {"schema": SCHEMA, "settings": asdict(s), **extra})
    report = run_bench(models, s, device=device, embeds=embeds, variants=default_variants("real-size", s.levels),
                       log=_log, extra=extra, progress=progress)
    _emit(report, args)
    return 0
