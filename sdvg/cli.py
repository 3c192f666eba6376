"""``python -m sdvg``: generate videos headless, write the tiny preset, benchmark and evaluate."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path

from .errors import SDVGError

EXIT_OK, EXIT_ERROR, EXIT_CANCELLED = 0, 2, 130
MODES = {"speculative": "reward", "target-only": "target-only", "draft-only": "draft-only", "random": "random"}


def _finite_or_inf(text: str) -> float:
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError("NaN is not a valid value")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the tiny preset, generated once into a cache folder)")
    g.add_argument("--models", help="a ComfyUI-style models folder (diffusion_models/, vae/, text_encoders/, image_reward/)")
    g.add_argument("--drafter", help="drafter DiT file (Self-Forcing 1.3B)")
    g.add_argument("--target", help="target DiT file (Krea Realtime 14B)")
    g.add_argument("--vae", help="Wan 2.1 VAE file")
    g.add_argument("--text-encoder", help="UMT5-XXL encoder file")
    g.add_argument("--reward", help="ImageReward.pt (vocab.txt beside it)")
    g.add_argument("--device", default="auto", help="device for both DiTs: auto, cpu, cuda:N (default auto)")
    g.add_argument("--aux-device", default=None, help="device for text encoder, VAE and reward (default: --device)")
    g.add_argument("--dtype", default="auto", help="DiT weight dtype: auto, bf16, fp16, fp32, fp8_e4m3fn")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads (default: torch's choice)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--blocks", type=int, help="number of 3-latent-frame blocks (default 7; 12·blocks−3 frames)")
    size.add_argument("--frames", type=int, help="number of output frames (rounded up to whole blocks, then trimmed)")
    g.add_argument("--width", type=int, help="multiple of 16 (default 832, tiny preset 64)")
    g.add_argument("--height", type=int, help="multiple of 16 (default 480, tiny preset 64)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache", choices=["recompute", "global", "noisy"], default="recompute", help="KV-cache regime")
    g.add_argument("--window", type=int, default=12, help="noisy regime: rolling window in latent frames")
    g.add_argument("--sinks", type=int, default=3, help="noisy regime: pinned sink frames")
    g.add_argument("--schedule", default="constant", help="constant | diagonal | '1000,750,500,250' | JSON list of lists")
    g.add_argument("--pipelined", action="store_true", help="draft block b+1 while block b is verified")
    g.add_argument("--first-frame", choices=["reencode", "latent"], default="reencode",
                   help="recompute regime: first context frame = an old pixel frame re-encoded (Krea) or latent 0")
    g.add_argument("--refine-from-step", type=int, default=None, help="on reject, the target refines the draft from this step")
    r = p.add_argument_group("routing")
    r.add_argument("--mode", choices=list(MODES), default="speculative")
    r.add_argument("--random-rate", type=float, default=0.5, help="accept rate of --mode random")
    r.add_argument("--tau", type=_finite_or_inf, default=-0.7, help="acceptance threshold τ (inf = reject all, -inf = accept all)")
    r.add_argument("--aggregation", choices=["min", "mean", "quantile"], default="min")
    r.add_argument("--quantile", type=float, default=0.1, help="q for --aggregation quantile")
    r.add_argument("--threshold", choices=["fixed", "target-rate", "relative"], default="fixed")
    r.add_argument("--target-rate", type=float, default=0.72, help="accept rate aimed at by --threshold target-rate")
    r.add_argument("--delta", type=float, default=0.5, help="--threshold relative: accept when q ≥ score(block 0) − δ")
    r.add_argument("--no-force-reject-first", action="store_true", help="let block 0 be drafted too")
    r.add_argument("--early-exit", action="store_true", help="stop scoring at the first frame below τ (min, fixed)")


def router_config_from_args(args):
    from .router import RouterConfig

    return RouterConfig(
        mode=MODES[args.mode],
        tau=args.tau,
        aggregation=args.aggregation,
        q=args.quantile,
        threshold=args.threshold,
        target_rate=args.target_rate,
        delta=args.delta,
        force_reject_first=not args.no_force_reject_first,
        random_rate=args.random_rate,
        seed=args.seed,
        early_exit=args.early_exit,
    )


def resolve_models(args, *, need: tuple[str, ...], log=None):
    """Load the models the run needs; without --models or explicit files, use (and create) the tiny preset."""
    from .fixtures.tiny import ensure_tiny, is_tiny_tree
    from .pipeline import load_models

    explicit = {k: getattr(args, k) for k in ("drafter", "target", "vae", "text_encoder", "reward")}
    models_dir, tiny = args.models, False
    if models_dir is None and not any(explicit.values()):
        models_dir, created = ensure_tiny()
        tiny = True
        if log:
            log(
                f"Using the tiny preset in {models_dir} ({'created now' if created else 'cached'}). "
                "Its random weights make noise videos; pass --models or model files for real ones."
            )
    if models_dir is not None and is_tiny_tree(models_dir):
        tiny = True  # a make-tiny folder: default to the tiny size
    models = load_models(
        models_dir, **explicit, need=need, dit_device=args.device, aux_device=args.aux_device or args.device,
        dtype=args.dtype,
    )
    return models, tiny


def sampler_config_from_args(args, tiny: bool):
    from .blocks import blocks_for_frames
    from .regimes import CacheConfig, CacheRegime
    from .sampler import SamplerConfig

    blocks = args.blocks if args.blocks is not None else (blocks_for_frames(args.frames) if args.frames else 7)
    from .fixtures.tiny import TINY_HEIGHT, TINY_WIDTH

    return SamplerConfig(
        num_blocks=blocks,
        width=args.width or (TINY_WIDTH if tiny else 832),
        height=args.height or (TINY_HEIGHT if tiny else 480),
        seed=args.seed,
        cache=CacheConfig(regime=CacheRegime(args.cache), window_frames=args.window, sink_frames=args.sinks,
                          first_frame=args.first_frame),
        schedule=_parse_schedule(args.schedule),
        pipelined=args.pipelined,
        refine_from_step=args.refine_from_step,
        num_frames=args.frames,
    )


def _parse_schedule(text: str):
    text = text.strip()
    if text.startswith("["):
        from .errors import ConfigError

        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--schedule is not valid JSON: {exc}") from exc
    return text


class _Progress:
    """One status line per block on stderr, redrawn per denoising step."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream, self.start = total, stream, time.perf_counter()
        self.live = stream.isatty()

    def step(self, ev) -> None:
        if not self.live:
            return
        self.stream.write(f"\r  block {ev.block + 1}/{self.total}  {ev.model:7s} step {ev.step + 1}/{ev.num_steps}   ")
        self.stream.flush()

    def block(self, ev) -> None:
        r = ev.record
        q = f"q={r.q:+.3f}" if r.q is not None and math.isfinite(r.q) else ""
        done = ev.block + 1
        bar = "#" * done + "." * (self.total - done)
        self.stream.write(
            f"{chr(13) if self.live else ''}[{bar}] block {done}/{self.total}: {r.decision:6s} by {r.produced_by:7s} {q}  "
            f"({time.perf_counter() - self.start:.1f}s)\n"
        )
        self.stream.flush()


def cmd_generate(args) -> int:
    from .pipeline import roles_needed
    from .report import render_timeline, summarize, write_report
    from .sampler import SpeculativeSampler
    from .video import save_tensor_file, to_uint8, write_mp4

    def log(msg: str) -> None:
        sys.stderr.write(msg + "\n")

    from .devices import set_cpu_threads

    set_cpu_threads(args.threads)
    router = router_config_from_args(args)
    router.validate()
    models, tiny = resolve_models(args, need=roles_needed(router.mode), log=log)
    config = sampler_config_from_args(args, tiny)
    sampler = SpeculativeSampler(models, router, config)
    progress = _Progress(config.num_blocks)
    interrupted = {"count": 0}

    def on_sigint(signum, frame):
        interrupted["count"] += 1
        if interrupted["count"] > 1:
            raise KeyboardInterrupt
        log("\nCtrl-C: stopping after the current step and writing what is finished (Ctrl-C again to abort).")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        result = sampler.run(
            args.prompt, on_block=progress.block, on_step=progress.step, cancel=lambda: interrupted["count"] > 0
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    report = result.report()
    if result.frames.shape[0]:
        log(f"wrote {write_mp4(result.frames, args.out)} ({result.frames.shape[0]} frames)")
    else:
        log("no block finished; no video written")
    if args.report:
        log(f"wrote {write_report(report, args.report)}")
    if args.save_latents and result.latents.numel():
        save_tensor_file(args.save_latents, "latents", result.latents, {"partial": result.partial})
        log(f"wrote {args.save_latents}")
    if args.save_frames and result.frames.shape[0]:
        save_tensor_file(args.save_frames, "frames", to_uint8(result.frames), {"partial": result.partial})
        log(f"wrote {args.save_frames}")
    if args.timeline:
        Path(args.timeline).parent.mkdir(parents=True, exist_ok=True)
        render_timeline(report).save(args.timeline)
        log(f"wrote {args.timeline}")
    sys.stdout.write(summarize(report) + "\n")
    return EXIT_CANCELLED if result.partial else EXIT_OK


def cmd_make_tiny(args) -> int:
    from .fixtures.tiny import make_tiny

    paths = make_tiny(args.dir)
    for role, path in paths.items():
        sys.stdout.write(f"{role:13s} {path}\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sdvg", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one video")
    gen.add_argument("--prompt", required=True)
    add_model_args(gen)
    add_sampling_args(gen)
    out = gen.add_argument_group("outputs")
    out.add_argument("--out", required=True, help="output .mp4")
    out.add_argument("--report", help="report JSON")
    out.add_argument("--save-latents", help="all latents as safetensors")
    out.add_argument("--save-frames", help="uint8 frames [F, H, W, 3] as safetensors")
    out.add_argument("--timeline", help="timeline PNG")
    gen.set_defaults(func=cmd_generate)
    tiny = sub.add_parser("make-tiny", help="write tiny random-weight models in the real formats")
    tiny.add_argument("dir")
    tiny.set_defaults(func=cmd_make_tiny)
    from . import bench, evaluate  # an import error here is a bug to see, not a subcommand to drop

    bench.add_parser(sub)
    evaluate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SDVGError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_ERROR
    except FileNotFoundError as exc:
        sys.stderr.write(f"error: file not found: {exc.filename or exc}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("aborted\n")
        return EXIT_CANCELLED
