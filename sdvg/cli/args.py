"""Command-line arguments shared by ``generate``, ``eval`` and ``bench``: the model files and devices, the sampling
and routing settings, and turning them into engine configs.

Everything is checked before a model loads: :func:`model_source` only looks at paths (with no model named it picks
the toy world's trained models, committed in ``sdvg/toy/models``), :func:`router_config_from_args` and :func:`sampler_config_from_args` return validated
configs, and :func:`load_from_source` loads the models last.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import DIT_DTYPES, ConfigError, blocks_for_frames
from ..sampling import (
    AGGREGATIONS,
    FIRST_FRAME_SOURCES,
    MODES,
    POSITIONS,
    REGIMES,
    STEP_NOISES,
    THRESHOLDS,
    CacheConfig,
    RouterConfig,
    SamplerConfig,
    add_compat_args,
    compat_from_args,
    parse_pattern,
)

ROLES = ("drafter", "target", "vae", "text_encoder", "reward")
# Every default below is the engine's (the config dataclasses' field defaults), read, never restated.
_R, _C, _S = RouterConfig, CacheConfig, SamplerConfig


def _finite_or_inf(text: str) -> float:
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError("NaN is not a valid value")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the toy world's trained models in sdvg/toy/models; a file given here "
                             "replaces its role)")
    g.add_argument("--models", help="a ComfyUI-style models folder (diffusion_models/, vae/, text_encoders/, image_reward/)")
    g.add_argument("--drafter", help="drafter DiT file (Self-Forcing 1.3B)")
    g.add_argument("--target", help="target DiT file (Krea Realtime 14B)")
    g.add_argument("--vae", help="Wan 2.1 VAE file")
    g.add_argument("--text-encoder", help="UMT5-XXL encoder file")
    g.add_argument("--reward", help="ImageReward.pt (vocab.txt beside it)")
    g.add_argument("--device", default="auto", help="device for both DiTs: auto, cpu, cuda:N (default auto)")
    g.add_argument("--aux-device", default=None, help="device for text encoder, VAE and reward (default: --device)")
    g.add_argument("--text-encoder-device", default=None, help="device for the text encoder alone (default: "
                   "--aux-device); cpu keeps UMT5-XXL off a small GPU (bf16 there when the DiTs are on CUDA)")
    g.add_argument("--dtype", default="auto", choices=DIT_DTYPES, help="DiT weight dtype, both DiTs (default auto)")
    for role in ("target", "drafter"):
        g.add_argument(f"--{role}-dtype", default=None, choices=DIT_DTYPES,
                       help=f"the {role} DiT's weight dtype (default: --dtype); e.g. --target-dtype fp8_e4m3fn "
                            "beside a bf16 drafter on a 24 GB card")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads (default: torch's choice)")
    for role in ("target", "drafter"):
        g.add_argument(f"--{role}-lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                       help=f"a Wan LoRA merged into the {role} DiT as it loads (strength default 1.0; repeatable, "
                            "strengths add)")
        g.add_argument(f"--{role}-offload-blocks", default=None, metavar="K|auto",
                       help=f"keep K {role} transformer blocks on the GPU and stream the rest from pinned CPU memory "
                            "(auto: as many as fit, leaving 14 GiB for caches and the other models)")
    g.add_argument("--lora-strict", action="store_true",
                   help="refuse a LoRA with keys the DiT has no place for (an I2V LoRA's image layers, text-encoder "
                        "keys) instead of skipping them with a warning")


def add_cache_args(g) -> None:
    g.add_argument("--cache", choices=REGIMES, default=_C.regime.value, help="KV-cache regime")
    g.add_argument("--window", type=int, default=_C.window_frames, help="noisy regime: rolling window in latent frames")
    g.add_argument("--sinks", type=int, default=_C.sink_frames,
                   help="noisy regime: pinned sink frames (the first frames ever written)")
    g.add_argument("--positions", choices=POSITIONS, default=_C.positions,
                   help="noisy regime: RoPE at the frames' absolute positions (length limited by the model's table) or "
                   "at their slots in the window (any length)")
    g.add_argument("--first-frame", choices=FIRST_FRAME_SOURCES, default=_C.first_frame,
                   help="recompute regime: first context frame = an old pixel frame re-encoded (Krea) or latent 0")


def add_sampling_args(p: argparse.ArgumentParser, *, profile_flag: str = "--profile") -> None:
    g = p.add_argument_group("sampling")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--blocks", type=int, help=f"number of 3-latent-frame blocks (default {_S.num_blocks}; "
                      "12·blocks−3 frames)")
    size.add_argument("--frames", type=int, help="number of output frames (rounded up to whole blocks, then trimmed)")
    g.add_argument("--width", type=int, help=f"multiple of 16 (default {_S.width}, tiny preset 64)")
    g.add_argument("--height", type=int, help=f"multiple of 16 (default {_S.height}, tiny preset 64)")
    g.add_argument("--seed", type=int, default=_S.seed)
    add_cache_args(g)
    g.add_argument("--schedule", default=None, help="constant | diagonal | diagonal-1 | '1000,750,500,250' | JSON list of lists "
                   f"(default {_S.schedule}; the toy world's models: their own 10-step list)")
    g.add_argument("--step-noise", choices=STEP_NOISES, default=None, help="between steps re-noise with "
                   "fresh noise (Self-Forcing, Krea) or the predicted noise (flow ODE Euler steps, for undistilled "
                   f"flow-matching models; the toy world's default); default {_S.step_noise}")
    add_drafter_schedule_args(g)
    g.add_argument("--pipelined", action="store_true", help="draft block b+1 while block b is verified")
    g.add_argument("--refine-from-step", type=int, default=None, help="on reject, the target refines the draft from this step")
    g.add_argument("--stitch", action="store_true", help="with --refine-from-step K: step stitch, the target continues "
                   "the drafter's own state at step K (its first K steps are kept; SDVG-hybrid)")
    r = p.add_argument_group("routing")
    r.add_argument("--mode", choices=MODES, default=_R.mode, help=f"routing mode (default {_R.mode}: SDVG)")
    r.add_argument("--random-rate", type=float, default=_R.random_rate, help="accept rate of --mode random")
    r.add_argument("--pattern", default=None, help="--mode pattern: A/R per drafted block, e.g. AARAAR")
    r.add_argument("--tau", type=_finite_or_inf, default=None, help="acceptance threshold τ (inf = reject all, -inf = "
                   f"accept all; default {_R.tau}, the paper's; the toy world's models: their critic's TOY_TAU)")
    r.add_argument("--aggregation", choices=AGGREGATIONS, default=_R.aggregation)
    r.add_argument("--quantile", type=float, default=_R.q, help="q for --aggregation quantile")
    r.add_argument("--threshold", choices=THRESHOLDS, default=_R.threshold)
    r.add_argument("--target-rate", type=float, default=_R.target_rate,
                   help="accept rate aimed at by --threshold target-rate")
    r.add_argument("--delta", type=float, default=_R.delta,
                   help="--threshold relative: accept when q ≥ score(block 0) − δ")
    r.add_argument("--no-force-reject-first", action="store_true", help="let block 0 be drafted too")
    r.add_argument("--early-exit", action="store_true", help="stop scoring at the first frame below τ (min, fixed)")
    r.add_argument("--cascade", type=int, default=_R.cascade, help="SDVG-hybrid cascade scoring: score K spread frames first; "
                   "one below τ is a safe reject (min, fixed τ; 0 = off)")
    add_score_frames_arg(r)
    add_compat_args(p, profile_flag=profile_flag)


def add_score_frames_arg(g) -> None:
    g.add_argument("--score-frames", type=int, default=None, help="score only K frames spread over each block (the "
                   f"block score aggregates those; 0 = every frame; default {_R.score_frames}, the toy world's models: "
                   "TOY_SCORE_FRAMES): cheaper scoring, a frame between them goes unseen")


def score_frames_from_args(args, preset: str | None = None) -> int:
    """``--score-frames``, or the default: the engine's (every frame), the toy world's on its models (every frame
    under ``--cascade``, which scores a subset first itself)."""
    from ..toy import TOY_SCORE_FRAMES

    given = getattr(args, "score_frames", None)
    if given is not None:
        return given
    return TOY_SCORE_FRAMES if preset == "toy" and not getattr(args, "cascade", 0) else _R.score_frames


def router_config_from_args(args, preset: str | None = None) -> RouterConfig:
    """The validated router settings; τ defaults to the engine's (the paper's), or to the toy critic's when the models
    are the toy world's (``preset == "toy"``)."""
    from ..toy import TOY_TAU

    mode = args.mode
    if (args.pattern is not None) != (mode == "pattern"):
        raise ConfigError("--pattern goes with --mode pattern (and --mode pattern needs --pattern, e.g. AARA).")
    tau = args.tau if args.tau is not None else (TOY_TAU if preset == "toy" else _R.tau)
    return RouterConfig(
        mode=mode, tau=tau, aggregation=args.aggregation, q=args.quantile, threshold=args.threshold,
        target_rate=args.target_rate, delta=args.delta, force_reject_first=not args.no_force_reject_first,
        random_rate=args.random_rate, seed=args.seed, early_exit=args.early_exit,
        cascade=getattr(args, "cascade", _R.cascade), score_frames=score_frames_from_args(args, preset),
        pattern=parse_pattern(args.pattern) if args.pattern is not None else None,
    ).validate()


def cache_config_from_args(args) -> CacheConfig:
    return CacheConfig(regime=args.cache, window_frames=getattr(args, "window", _C.window_frames),
                       sink_frames=getattr(args, "sinks", _C.sink_frames),
                       first_frame=getattr(args, "first_frame", _C.first_frame),
                       positions=getattr(args, "positions", _C.positions))


def preset_defaults(preset: str | None) -> dict:
    """Size, block count and step schedule a models preset runs at unless the command line says otherwise."""
    from ..fixtures import TINY_HEIGHT, TINY_WIDTH
    from ..toy import TOY_BLOCKS, TOY_SCHEDULE, TOY_SIZE, TOY_STEP_NOISE

    if preset == "toy":
        return {"size": TOY_SIZE, "blocks": TOY_BLOCKS, "schedule": json.dumps(TOY_SCHEDULE),
                "step_noise": TOY_STEP_NOISE}
    if preset == "tiny":
        return {"size": (TINY_WIDTH, TINY_HEIGHT), "blocks": None, "schedule": _S.schedule, "step_noise": _S.step_noise}
    return {"size": (_S.width, _S.height), "blocks": None, "schedule": _S.schedule, "step_noise": _S.step_noise}


def sampler_config_from_args(args, preset: str | None, *, default_blocks: int = _S.num_blocks,
                             keep_output: bool = True, drafter: dict[str, str] | None = None):
    """The validated ``SamplerConfig`` (size, blocks and schedule default to the preset's when a preset is the model
    source: ``"toy"``, ``"tiny"`` or None); ``keep_output=False`` when the frames are streamed to disk as they come
    (``generate --out``); ``drafter``: the drafter's own schedule / step noise unless the command line gives them
    (:attr:`ModelSource.drafter_sampling`; not with --refine-from-step, which runs both models on one schedule)."""
    defaults = preset_defaults(preset)
    drafter = {} if getattr(args, "refine_from_step", None) is not None else (drafter or {})
    drafter_schedule = getattr(args, "drafter_schedule", None) or drafter.get("schedule")
    default_blocks = defaults["blocks"] or default_blocks
    frames = getattr(args, "frames", None)
    blocks = args.blocks if args.blocks is not None else (blocks_for_frames(frames) if frames else default_blocks)
    width, height = defaults["size"]
    schedule = args.schedule if args.schedule is not None else defaults["schedule"]
    return SamplerConfig(
        num_blocks=blocks,
        width=width if args.width is None else args.width,
        height=height if args.height is None else args.height,
        seed=args.seed,
        cache=cache_config_from_args(args),
        schedule=_parse_schedule(schedule),
        step_noise=getattr(args, "step_noise", None) or defaults["step_noise"],
        drafter_schedule=_parse_schedule(drafter_schedule) if drafter_schedule else None,
        drafter_step_noise=getattr(args, "drafter_step_noise", None) or drafter.get("step_noise"),
        pipelined=getattr(args, "pipelined", False),
        refine_from_step=getattr(args, "refine_from_step", None),
        stitch=getattr(args, "stitch", False),
        num_frames=frames,
        compat=compat_from_args(args),
        keep_output=keep_output,
    ).validate()


def _parse_schedule(text: str):
    text = text.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--schedule is not valid JSON: {exc}") from exc
    return text


@dataclass
class ModelSource:
    """Where the models come from: a models tree and/or explicit files; ``preset`` names the tree when it is one of
    ours ("toy": the toy world's trained models, "tiny": the random-weight format preset)."""

    models_dir: Path | None
    files: dict[str, str | None]
    preset: str | None
    loras: dict[str, list] = field(default_factory=dict)  # DiT role → LoraSpec list (--target-lora, --drafter-lora)
    offload: dict[str, int | str | None] = field(default_factory=dict)  # DiT role → resident blocks / "auto"
    drafter_sampling: dict[str, str] = field(default_factory=dict)  # the tree drafter's own schedule / step noise


def model_source(args, *, log=None) -> ModelSource:
    """Decide where the models come from, without loading any. With no ``--models`` the toy world's trained models
    fill every role no file is given for (and that is said)."""
    from ..fixtures import is_tiny_tree
    from ..toy import is_toy_tree, toy_drafter_sampling, toy_tree

    files = {k: getattr(args, k) for k in ROLES}
    models_dir = Path(args.models) if args.models is not None else None
    if models_dir is None and not all(files.values()):
        models_dir = toy_tree()
        if log:
            given = [k for k, v in files.items() if v]
            log(f"Using the toy world's trained models ({models_dir})"
                + (f" for every role but {', '.join(given)}" if given else "")
                + ". They draw toy captions such as 'a red circle moving left on a black background' at 64x64; "
                "pass --models or model files for real ones.")
    preset = "toy" if is_toy_tree(models_dir) else "tiny" if models_dir is not None and is_tiny_tree(models_dir) else None
    drafter = toy_drafter_sampling(models_dir) if preset == "toy" and not files["drafter"] else {}
    return ModelSource(models_dir, files, preset, *dit_options(args), drafter_sampling=drafter)


def dit_options(args) -> tuple[dict[str, list], dict[str, int | str | None]]:
    """The LoRAs and block-offload settings of both DiTs from the command line, checked (files exist, strengths and
    block counts are numbers) before anything loads."""
    from ..loaders import parse_lora_arg
    from ..models import parse_offload

    roles = ("target", "drafter")
    strict = bool(getattr(args, "lora_strict", False))
    loras = {r: [replace(parse_lora_arg(x), strict=strict) for x in getattr(args, f"{r}_lora", None) or ()]
             for r in roles}
    offload = {r: parse_offload(getattr(args, f"{r}_offload_blocks", None)) for r in roles}
    return {r: v for r, v in loras.items() if v}, offload


def load_kwargs(source: ModelSource, args, *, need: tuple[str, ...]) -> dict:
    """``load_models``' arguments from the command line: one home for the in-process load and the Ray actors'."""
    return {"models_dir": source.models_dir, **source.files, "need": need, "dit_device": args.device,
            "aux_device": args.aux_device or args.device, "dtype": args.dtype,
            "dtypes": {r: getattr(args, f"{r}_dtype", None) for r in ("target", "drafter")}, "loras": source.loras,
            "offload": source.offload, "text_device": getattr(args, "text_encoder_device", None),
            "pt_weights": compat_from_args(args).pt_weights}


def provenance(source: ModelSource, args) -> dict:
    """What of the model choice changes an evaluation's numbers (files, tree, LoRAs, dtypes — not the devices: a
    resume on another card is allowed), recorded with its settings."""
    kw = load_kwargs(source, args, need=ROLES)
    return {k: kw[k] for k in ("models_dir", *source.files, "loras", "dtype", "dtypes", "pt_weights")}


def load_from_source(source: ModelSource, args, *, need: tuple[str, ...]):
    from ..loaders import load_models

    return load_models(**load_kwargs(source, args, need=need))


def add_drafter_schedule_args(g) -> None:
    g.add_argument("--drafter-schedule", default=None, help="the drafter's own step schedule (a distilled few-step "
                   "drafter beside an undistilled target, e.g. a Diagonal Distillation student: diagonal, or diagonal-1 — one "
                   "step a block after the first); default: the target's")
    g.add_argument("--drafter-step-noise", choices=STEP_NOISES, default=None, help="the drafter's own "
                   "step noise (a distilled student: fresh); default: the target's")


def eval_world(args) -> dict:
    """The defaults an evaluation takes from ``--world``: prompts, methods, τ and metrics."""
    from ..eval import DEFAULT_METHODS, DEFAULT_TAUS, METHODS

    if args.world == "toy":  # the toy models are the default model source anyway
        from ..toy import TOY_RATE_PRIOR, TOY_RATES, TOY_TAUS, toy_eval_items

        prompts, seeds = toy_eval_items(quick=args.quick)
        return {"methods": ",".join(METHODS), "taus": ",".join(f"{t:g}" for t in TOY_TAUS),
                "rates": ",".join(f"{r:g}" for r in TOY_RATES), "rate_router": TOY_RATE_PRIOR,
                "prompts": prompts, "seeds": seeds, "metrics": ["sdvg.toy.judge:judge_metric"]}
    if args.quick:
        raise ConfigError("--quick picks the toy world's short prompt set; use it with --world toy.")
    if args.prompts is None:
        raise ConfigError("eval needs --prompts FILE (one prompt per line), or --world toy for the toy world.")
    return {"methods": ",".join(DEFAULT_METHODS), "taus": ",".join(f"{t:g}" for t in DEFAULT_TAUS), "prompts": [],
            "metrics": [], "rates": "", "seeds": None, "rate_router": None}
