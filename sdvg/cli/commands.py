"""``python -m sdvg``: generate videos headless, write the tiny preset, benchmark and evaluate."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from .. import ConfigError, SDVGError
from ..sampling import STEP_NOISES, SamplerConfig
from ..stop import EXIT_CANCELLED, EXIT_ERROR, EXIT_OK, StopSignals
from . import args as cli_args


class _StreamedVideo:
    """``--out`` written block by block as the video is made (no whole video in RAM). A failing write stops the
    stream (nothing is left behind) and is reported with the other outputs; the run goes on."""

    def __init__(self, path, max_frames: int | None) -> None:
        from ..outputs import Mp4Stream

        self.stream = Mp4Stream(path, max_frames=max_frames) if path is not None else None
        self.failure: Exception | None = None

    def write(self, event) -> None:
        if self.stream is None or self.failure is not None:
            return
        try:
            self.stream.write(event.frames)
        except Exception as exc:  # noqa: BLE001 - a full disk must not cost the run or the other outputs
            self.failure = exc

    def finish(self, path):
        if self.failure is not None:
            raise self.failure
        return self.stream.close()

    @property
    def empty(self) -> bool:
        return self.stream is not None and self.failure is None and self.stream.frames_written == 0


def _write_outputs(result, plan, log, video: _StreamedVideo) -> list[str]:
    """Write every planned output that has content, the report first (small, and it explains the rest); the video
    was streamed during the run and is finished here. A failing output is reported and the others are still written.
    Returns the failures' messages."""
    from ..outputs import OUTPUTS, save_tensor_file, to_uint8, write_report, write_timeline

    report, frames, meta = result.report(), result.frames, {"partial": result.partial}
    writers = {
        "report": lambda p: write_report(report, p),
        "video": video.finish,
        "latents": lambda p: save_tensor_file(p, "latents", result.latents, meta),
        "frames": lambda p: save_tensor_file(p, "frames", to_uint8(frames), meta),
        "timeline": lambda p: write_timeline(report, p),
    }
    empty = {"video": video.empty, "frames": not frames.shape[0], "latents": not result.latents.numel()}
    failures = []
    for role, write in writers.items():
        path = plan[role]
        if path is None:
            continue
        if empty.get(role):
            log(f"no block finished; {OUTPUTS[role][0]} {path} not written")
            continue
        try:
            write(path)
        except Exception as exc:  # noqa: BLE001 - any failure of one output must not cost the others
            failures.append(f"could not write {OUTPUTS[role][0]} {path}: {type(exc).__name__}: {exc}")
            continue
        log(f"wrote {path}" + (f" ({video.stream.frames_written} frames)" if role == "video" else ""))
    return failures


def cmd_generate(args) -> int:
    from .. import RunFailed, set_cpu_threads
    from ..outputs import block_line, plan_outputs, summarize
    from ..sampling import SpeculativeSampler
    from . import inputs, preflight
    from .progress import Progress

    def log(msg: str) -> None:
        sys.stderr.write(msg + "\n")

    set_cpu_threads(args.threads)
    # every setting and every output path is checked before a model loads: a typo never costs a 28 GB load
    source = cli_args.model_source(args, log=log)  # paths only: nothing loads before every setting is checked
    router = cli_args.router_config_from_args(args, source.preset)
    # frames go to --out as they come; only --save-frames/--save-latents need the whole video in RAM
    config = cli_args.sampler_config_from_args(args, source.preset, keep_output=bool(args.save_frames or args.save_latents),
                                               drafter=source.drafter_sampling)
    replace(router, num_blocks=config.num_blocks).validate()  # what depends on the length (a pattern's)
    prompt = inputs.check_prompts(args, config.num_blocks)
    inputs.check_start_frames(args, config)
    plan = plan_outputs({"video": args.out, "report": args.report, "timeline": args.timeline,
                         "latents": args.save_latents, "frames": args.save_frames})
    preflight.check_disk_space(plan, config)
    need = router.roles_needed
    preflight.check_dits_fit(source, need, config)
    models = cli_args.load_from_source(source, args, need=need)
    video, init = inputs.v2v_video(args, config, models.vae), inputs.init_blocks(args, models.vae)
    sampler = SpeculativeSampler(models, router, config)
    progress, fault = Progress(config.num_blocks, block_line), None
    stream = _StreamedVideo(plan["video"], config.num_frames)

    def on_block(event) -> None:
        stream.write(event)
        progress.block(event)

    with StopSignals(log) as stop:
        try:
            result = sampler.run(prompt, on_block=on_block, on_step=progress.step, cancel=stop.requested, video=video,
                                 init=init)
        except RunFailed as exc:  # a fault in one block: the finished ones are still written
            result, fault = exc.result, str(exc)
        except BaseException:
            if stream.stream is not None:
                stream.stream.abort()
            raise
    failures = _write_outputs(result, plan, log, stream)
    sys.stdout.write(summarize(result.report(), blocks=False) + "\n")  # the block lines went out as they finished
    for message in ([fault] if fault else []) + failures:
        log(f"error: {message}")
    if fault or failures:
        return EXIT_ERROR
    return stop.exit_code if result.partial else EXIT_OK


def add_eval_parser(subparsers) -> None:
    from ..eval import DEFAULT_TAUS

    p = subparsers.add_parser(
        "eval", help="quality vs speed over a prompt file: target-only, draft-only, SDVG τ sweep, matched random",
        description=evaluate_doc(),
    )
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (see bench/prompts_sample.txt); "
                   "required unless --world toy")
    p.add_argument("--world", choices=["toy"], default=None, help="toy: the toy world's models, its 72 held-out "
                   "captions × seeds 0 and 1, its judge as the quality metric (judge, judge_lo, judge_hi in "
                   "summary.csv), every method, τ in the critic's range and target rates 0.2, 0.4, 0.6, unless given")
    p.add_argument("--quick", action="store_true", help="with --world toy: 8 held-out captions, seed 0 (CI)")
    p.add_argument("--rates", default=None, help="target acceptance rates of the sdvg-rate / random-rate rows "
                   "(the drafter's share of all blocks, comma list in (0, 1); --world toy: 0.2,0.4,0.6)")
    p.add_argument("--out", required=True, help="output folder (results.csv, summary.csv, pareto.png, videos/); "
                   "rerun with the same folder to resume")
    p.add_argument("--taus", default=None, help="τ sweep (default " + ",".join(f"{t:g}" for t in DEFAULT_TAUS)
                   + "; --world toy: the toy critic's)")
    p.add_argument("--methods", default=None, help="comma list of target-only, draft-only, target0-draft (block 0 by "
                   "the target, the rest drafted), sdvg, random, refine (rejected drafts refined from half their "
                   "steps) (default: the first five; --world toy: all six)")
    p.add_argument("--metric", action="append", default=[], help="external video metric module:callable "
                   "(repeatable); e.g. sdvg.eval.run:temporal_flicker")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-rows", type=int, default=None, help="stop after N new rows (rerun to continue)")
    p.add_argument("--no-videos", action="store_true", help="do not write mp4 files")
    cli_args.add_model_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--blocks", type=int, default=None, help=f"blocks per video (default {SamplerConfig.num_blocks}; "
                   "tiny preset 3)")
    g.add_argument("--width", type=int, default=None)
    g.add_argument("--height", type=int, default=None)
    g.add_argument("--seed", type=int, default=SamplerConfig.seed)
    cli_args.add_cache_args(g)
    g.add_argument("--schedule", default=None, help=f"default {SamplerConfig.schedule}; the toy world's models: their "
                   "own")
    g.add_argument("--step-noise", choices=STEP_NOISES, default=None, help=f"default {SamplerConfig.step_noise}; the "
                   "toy world's models: predicted (flow ODE)")
    cli_args.add_drafter_schedule_args(g)
    cli_args.add_score_frames_arg(g)
    cli_args.add_compat_args(p)
    r = p.add_argument_group("Ray (optional extra: pip install '.[ray]')")
    r.add_argument("--ray", default=None, metavar="auto|ADDRESS", help="run prompts as tasks on a Ray cluster, one "
                   "actor per GPU holding the models (auto: RAY_ADDRESS or a local cluster)")
    r.add_argument("--ray-actors", type=int, default=None, help="actors to start (default: one per GPU, else 1)")
    r.add_argument("--ray-retries", type=int, default=2, help="tries again for a failed prompt before reporting it")
    p.set_defaults(func=cmd_eval)


def evaluate_doc() -> str:
    from ..eval import run as evaluate

    return evaluate.__doc__.split("\n\n")[0]


def cmd_eval(args) -> int:
    from .. import set_cpu_threads
    from ..eval import (
        METHODS,
        check_eval_args,
        check_out_dir,
        check_plan,
        check_run_settings,
        evaluate,
        format_paired,
        format_summary,
        load_metric,
        parse_taus,
        read_prompts,
        run_settings,
    )

    def log(msg: str) -> None:
        sys.stderr.write(msg + "\n")  # CLI output of the command

    world = cli_args.eval_world(args)
    methods = tuple(m.strip() for m in (args.methods or world["methods"]).split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"Unknown or empty --methods {list(bad or methods)}; use a comma list of {', '.join(METHODS)}.")
    check_eval_args(args.limit, args.max_rows)  # 0 or a negative number never means "all"
    taus = parse_taus(args.taus or world["taus"])
    rate_text = args.rates if args.rates is not None else world["rates"]
    rates = parse_taus(rate_text, "--rates") if rate_text else ()
    methods = _rate_methods(methods, rates, args, log)
    seeds = None if args.prompts is not None else world["seeds"]
    prompts = read_prompts(args.prompts) if args.prompts is not None else world["prompts"]
    prompts = prompts[: args.limit] if args.limit else prompts
    seeds = seeds[: len(prompts)] if seeds is not None else None
    check_plan(prompts, taus, methods, args.max_rows, rates, args.score_frames or 0)
    check_out_dir(args.out)
    if args.ray:
        from ..eval import import_ray

        import_ray()  # a missing extra is named before anything loads
    metrics = [load_metric(spec) for spec in [*world["metrics"], *args.metric]]
    source = cli_args.model_source(args, log=log)
    blocks = 3 if source.preset else SamplerConfig.num_blocks
    config = cli_args.sampler_config_from_args(args, source.preset, default_blocks=blocks,
                                               drafter=source.drafter_sampling)
    score_frames = cli_args.score_frames_from_args(args, source.preset)
    provenance = cli_args.provenance(source, args)
    settings = run_settings(config, score_frames, world["rate_router"], provenance)
    check_run_settings(check_out_dir(args.out), settings, write=False)  # a changed resume: refused before loading
    if args.ray:
        return _eval_on_ray(args, source, config, prompts, taus, methods, log, seeds, score_frames,
                            provenance, world["rate_router"])
    models = cli_args.load_from_source(source, args, need=cli_args.ROLES)
    dev = models.target_device
    set_cpu_threads(getattr(args, "threads", None), 1 if dev is not None and dev.type == "cpu" else None)
    log(f"eval: {len(prompts)} prompt(s), methods {', '.join(methods)}, τ {', '.join(map(str, taus))}, "
        f"{config.num_blocks} blocks at {config.width}x{config.height}, {set_cpu_threads(None)} thread(s), reward rows "
        f"scoring {score_frames or 'every'} frame(s) a block")
    res = evaluate(models, prompts, args.out, taus=taus, methods=methods, sampler_config=config, metrics=metrics,
                   max_rows=args.max_rows, save_videos=not args.no_videos, log=log, rates=rates, seeds=seeds,
                   rate_router=world["rate_router"], score_frames=score_frames, provenance=provenance)
    sys.stdout.write(format_summary(res["summary"]) + "\n\n" + format_paired(res["paired"]) + "\n")  # CLI output
    state = "complete" if res["complete"] else "incomplete (rerun the same command to continue)"
    log(f"{res['written']} row(s) written, {res['skipped']} already done; {state}. Results: {res['results']}")
    return 0


RATE_METHODS = ("sdvg-rate", "random-rate")


def _rate_methods(methods: tuple[str, ...], rates: tuple[float, ...], args, log) -> tuple[str, ...]:
    """The default method list loses the target-rate rows where they cannot run (no rates, or on Ray); methods named
    with --methods are refused there instead, with the reason, before anything loads."""
    asked = [m for m in methods if m in RATE_METHODS]
    if not asked or (rates and not args.ray):
        return methods
    why = ("need target rates: pass --rates (e.g. 0.2,0.4,0.6)" if not rates else
           "are not run on Ray (their threshold pools one process's scores); run without --ray for them")
    if args.methods:
        raise ConfigError(f"--methods {','.join(asked)}: the target-rate rows {why}.")
    if args.ray:
        log(f"eval --ray: the target-rate rows ({', '.join(asked)}) {why}; paired.csv is not written")
    return tuple(m for m in methods if m not in RATE_METHODS)


def _eval_on_ray(args, source, config, prompts, taus, methods, log, seeds=None, score_frames: int = 0,
                 provenance=None, rate_router=None) -> int:
    from ..eval import evaluate_ray, format_summary

    if args.ray_actors is not None and args.ray_actors < 1:
        raise ConfigError(f"--ray-actors must be at least 1, got {args.ray_actors}.")
    load_kwargs = {**cli_args.load_kwargs(source, args, need=cli_args.ROLES), "threads": getattr(args, "threads", None)}
    res = evaluate_ray(args.ray, load_kwargs, prompts, args.out, taus=taus, methods=methods, sampler_config=config,
                       metric_specs=args.metric, actors=args.ray_actors, retries=args.ray_retries,
                       save_videos=not args.no_videos, log=log, seeds=seeds, score_frames=score_frames,
                       rate_router=rate_router, provenance=provenance)
    sys.stdout.write(format_summary(res["summary"]) + "\n")  # CLI output of the command
    state = "complete" if res["complete"] else "incomplete (rerun the same command to continue)"
    log(f"{res['written']} row(s) written, {res['skipped']} already done; {state}. Results: {res['results']}")
    return EXIT_ERROR if res["failed"] else 0


def cmd_inspect(args) -> int:
    from ..loaders import describe_model_file

    for path in args.files:
        sys.stdout.write(describe_model_file(path) + "\n")
    return EXIT_OK


def cmd_make_tiny(args) -> int:
    from ..fixtures import make_tiny

    paths = make_tiny(args.dir)
    for role, path in paths.items():
        sys.stdout.write(f"{role:13s} {path}\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sdvg", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one video")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-schedule", help="a prompt timeline: '0:a fox in snow|4:the fox jumps' (prompts start "
                        "at those blocks) or a .json file ([{\"block\": 0, \"prompt\": ...}, ...])")
    gen.add_argument("--blend-blocks", type=int, default=0, help="--prompt-schedule: interpolate the text embeddings "
                     "over this many blocks after each switch (Krea); 0 = switch at once")
    cli_args.add_model_args(gen)
    cli_args.add_sampling_args(gen)
    frames = gen.add_argument_group("starting from frames")
    init = frames.add_mutually_exclusive_group()
    init.add_argument("--init-image", help="image-to-video: this image (same size as the output) is held for block 0's "
                      "9 frames; the rest is generated from it")
    init.add_argument("--init-video", help="extension: this clip's first 9 + 12k frames become the first k + 1 blocks "
                      "(given, never drafted or scored); --blocks counts them too")
    init.add_argument("--init-latents", help="extension: a --save-latents file of a finished run; its blocks come first "
                      "(the same seed and settings continue that video exactly)")
    frames.add_argument("--v2v-video", help="video-to-video: denoise this video's frames (same size as the output) "
                        "instead of noise, each block from --strength (Krea)")
    frames.add_argument("--strength", type=float, default=None, help="--v2v-video: 1 = text-to-video (ignore the "
                        "video), 0 = the video itself; e.g. 0.6")
    out = gen.add_argument_group("outputs")
    out.add_argument("--out", required=True, help="output .mp4")
    out.add_argument("--report", help="report JSON")
    out.add_argument("--save-latents", help="all latents as safetensors")
    out.add_argument("--save-frames", help="uint8 frames [F, H, W, 3] as safetensors")
    out.add_argument("--timeline", help="timeline PNG")
    gen.set_defaults(func=cmd_generate)
    inspect = sub.add_parser("inspect", help="say what model files are (kind, size, dtype, layout) without loading them")
    inspect.add_argument("files", nargs="+")
    inspect.set_defaults(func=cmd_inspect)
    tiny = sub.add_parser("make-tiny", help="write tiny random-weight models in the real formats")
    tiny.add_argument("dir")
    tiny.set_defaults(func=cmd_make_tiny)
    from ..toy import cli as toy_cli

    toy_cli.add_parser(sub)
    from ..train import cli as train_cli

    train_cli.add_parser(sub)
    from ..bench import cli as bench_cli  # an import error here is a bug to see, not a subcommand to drop

    bench_cli.add_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # builds every subcommand's parser: imports most of the package
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except SDVGError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_ERROR
    except FileNotFoundError as exc:
        sys.stderr.write(f"error: file not found: {exc.filename or exc}\n")
        return EXIT_ERROR
    except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:  # a path given where a file goes
        sys.stderr.write(f"error: {exc.filename or exc}: {exc.strerror or exc}; give a readable file.\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("aborted\n")
        return EXIT_CANCELLED
