"""Every hyper-parameter of a Diagonal Distillation run, in one dataclass; a JSON config file holds any subset.

The defaults train on the toy world with no other argument: the toy target (its 10-step flow model) is the teacher
and the initial fake score, the toy drafter is the student, captions come from the world's generator. At real scale a
config file (``configs/diagonal_self_forcing_1p3b.json``) names the teacher, the student's initial weights, a prompt
folder and the 1.3B's latent shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import ConfigError

CACHES = ("noisy", "clean")  # diagonal forcing (the block's last noisy step) | Self-Forcing's clean re-run at t = 0
TEACHER_ATTENTION = ("causal", "full")


@dataclass
class DiagonalTrainConfig:
    """A Diagonal Distillation run. Paths left ``None`` mean the toy world's file for that role."""

    teacher: str | None = None  # the real score: a frozen DiT (any accepted format)
    student_init: str | None = None  # the generator's initial weights (a causal DiT); default: the teacher's
    fake_init: str | None = None  # the fake score's initial weights (default: the teacher's, as Self-Forcing)
    data: str = "toy"  # "toy" (the toy world's training captions) | a .txt file / folder of .txt files (one prompt per line) | a text-embedding .pt cache
    text_encoder: str | None = None  # needed for a prompt file or folder (embeddings are computed once and cached)
    out: str = "out/diagonal"
    # the video the student rolls out in training
    num_blocks: int = 3
    latent_hw: tuple[int, int] = (8, 8)
    frames_per_block: int = 3
    # the student's sampling: the schedule it is trained on is the one it will be sampled with
    schedule: str | list = "diagonal"  # "diagonal" | "constant" | per-block lists (scheduler.build_step_schedule)
    cache: str = "noisy"  # diagonal forcing; "clean" = Self-Forcing's clean cache (the ablation)
    step_noise: str = "fresh"  # between the student's steps: fresh noise (Self-Forcing) | "predicted" (flow ODE)
    shift: float = 5.0
    # DMD (Self-Forcing's model/dmd.py values unless noted)
    teacher_attention: str = "causal"  # causal: each block's score given the generated blocks before it (toy)
    real_guidance: float = 1.0  # CFG on the real score; > 1 needs a negative prompt ("" is encoded)
    min_t: float = 0.02
    max_t: float = 0.98
    score_shift: float = 5.0
    dmd_weight: float = 0.1  # toy: the ODE regression leads (see docs/TRAINING.md); the reference's is 1
    # teacher ODE pairs (CausVid / Self-Forcing ODE init; DiagDistill's teacher regression term, ode_pairs.py)
    regression_weight: float = 1.0  # 0 = pure DMD
    ode_pairs: int = 512
    teacher_schedule: str | list | None = None  # None: the toy target's own 10-step list
    teacher_step_noise: str = "predicted"  # the toy target is an undistilled flow model: ODE (Euler) steps
    teacher_cache: str = "clean"
    flow_weight: float = 0.2  # flow distribution matching (temporal-difference DMD + motion head), relative to DMD
    motion_head: bool = True
    motion_hidden: int = 64
    motion_ema: float = 0.95
    # optimisation
    steps: int = 600
    batch: int = 8
    lr: float = 2e-5 * 10  # toy: 10× Self-Forcing's 2e-6 for the generator (tiny models, few steps)
    lr_fake: float = 4e-5 * 10
    betas: tuple[float, float] = (0.0, 0.999)
    weight_decay: float = 0.01
    warmup: int = 20
    gen_every: int = 5  # fake-score updates per generator update (Self-Forcing's dfake_gen_update_ratio 5)
    grad_clip: float = 10.0
    ema: float = 0.99
    seed: int = 0
    save_every: int = 100  # iterations between saves of state.pt ...
    save_every_minutes: float = 10.0  # ... or minutes, whichever comes first (0: by iterations only)
    log_every: int = 10
    # devices and precision (the real scale; on CPU everything is fp32)
    device: str = "cpu"
    autocast: str = "auto"  # auto: bf16 autocast on CUDA | "bf16" | "off"
    gradient_checkpointing: bool = False
    fsdp: bool = False  # under torchrun: FSDP2 (fully_shard) for student, teacher, fake score and EMA instead of DDP
    note: dict = field(default_factory=dict)

    def validate(self) -> DiagonalTrainConfig:
        """Every key's type, then every value's range: one ConfigError naming all problems, before anything loads."""
        problems = [p for f in fields(self) if (p := _type_problem(f.name, getattr(self, f.name), f.type))]
        if problems:
            raise ConfigError("Bad training config: " + "; ".join(problems) + ".")
        problems = _range_problems(self)
        if self.cache not in CACHES:
            problems.append(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.teacher_attention not in TEACHER_ATTENTION:
            problems.append(f"teacher_attention must be one of {TEACHER_ATTENTION}, got {self.teacher_attention!r}")
        for name in ("step_noise", "teacher_step_noise"):
            if getattr(self, name) not in ("fresh", "predicted"):
                problems.append(f"{name} must be fresh or predicted, got {getattr(self, name)!r}")
        if self.teacher_cache not in CACHES:
            problems.append(f"teacher_cache must be one of {CACHES}, got {self.teacher_cache!r}")
        if self.regression_weight < 0 or (self.regression_weight > 0 and self.ode_pairs < 1):
            problems.append("regression_weight must be >= 0, and ode_pairs >= 1 when it is used")
        if self.autocast not in ("auto", "bf16", "off"):
            problems.append(f"autocast must be auto, bf16 or off, got {self.autocast!r}")
        if not 0.0 <= self.min_t < self.max_t <= 1.0:
            problems.append(f"need 0 <= min_t < max_t <= 1, got {self.min_t}, {self.max_t}")
        if self.flow_weight < 0 or self.real_guidance < 1.0:
            problems.append("flow_weight must be >= 0 and real_guidance >= 1")
        if self.data != "toy" and not str(self.data).endswith(".pt") and self.text_encoder is None:
            problems.append("a prompt file or folder needs text_encoder (--text-encoder FILE)")
        if problems:
            raise ConfigError("Bad training config: " + "; ".join(problems) + ".")
        return self

    def to_json(self) -> dict:
        return asdict(self)


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "list": list, "dict": dict, "None": type(None)}


def _fits(value, kind: str) -> bool:
    if kind.startswith("tuple["):
        inner = [k.strip() for k in kind[6:-1].split(",")]
        return (isinstance(value, (list, tuple)) and len(value) == len(inner)
                and all(_fits(v, k) for v, k in zip(value, inner, strict=True)))
    if isinstance(value, bool) and kind != "bool":
        return False  # JSON true is not a number
    return isinstance(value, _TYPES[kind])


def _type_problem(name: str, value, annotation: str) -> str | None:
    kinds = [k.strip() for k in str(annotation).split("|")]
    if any(_fits(value, k) for k in kinds):
        return None
    want = " or ".join("null" if k == "None" else f"a [{k[6:-1]}] list" if k.startswith("tuple[") else k
                       for k in kinds)
    return f"{name} must be {want}, got {value!r}"


_POSITIVE = ("lr", "lr_fake", "grad_clip", "shift", "score_shift")
_NON_NEGATIVE = ("weight_decay", "warmup", "dmd_weight", "ode_pairs", "save_every_minutes", "seed")
_AT_LEAST_ONE = ("num_blocks", "frames_per_block", "steps", "batch", "gen_every", "save_every", "log_every",
                 "motion_hidden")
_FRACTIONS = ("ema", "motion_ema")  # in [0, 1)


def _range_problems(cfg: DiagonalTrainConfig) -> list[str]:
    problems = [f"{n} must be > 0, got {getattr(cfg, n)}" for n in _POSITIVE if not getattr(cfg, n) > 0]
    problems += [f"{n} must be >= 0, got {getattr(cfg, n)}" for n in _NON_NEGATIVE if getattr(cfg, n) < 0]
    problems += [f"{n} must be at least 1, got {getattr(cfg, n)}" for n in _AT_LEAST_ONE if getattr(cfg, n) < 1]
    problems += [f"{n} must be in [0, 1), got {getattr(cfg, n)}" for n in _FRACTIONS if not 0 <= getattr(cfg, n) < 1]
    if not all(0 <= b < 1 for b in cfg.betas):
        problems.append(f"betas must both be in [0, 1), got {list(cfg.betas)}")
    if not all(v >= 1 for v in cfg.latent_hw):
        problems.append(f"latent_hw must be two sizes >= 1, got {list(cfg.latent_hw)}")
    from ..sampling.scheduler import FlowMatchScheduler, build_step_schedule

    if cfg.shift > 0 and cfg.num_blocks >= 1:
        try:
            build_step_schedule(cfg.schedule, cfg.num_blocks, FlowMatchScheduler(cfg.shift))
        except ConfigError as exc:
            problems.append(f"schedule: {str(exc).rstrip('.')}")
    return problems


def load_config(path: str | Path | None = None, **overrides) -> DiagonalTrainConfig:
    """The defaults, then the JSON file's keys, then ``overrides`` (None values are skipped)."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        try:
            values = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"Training config {p} does not exist.") from None
        except ValueError as exc:
            raise ConfigError(f"Training config {p} is not valid JSON: {exc}.") from None
        if not isinstance(values, dict):
            raise ConfigError(f"Training config {p} must hold a JSON object of hyper-parameters.")
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(DiagonalTrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"Unknown training config key(s) {unknown}; known keys: {', '.join(sorted(known))}.")
    for key in ("latent_hw", "betas"):
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    return DiagonalTrainConfig(**values).validate()
