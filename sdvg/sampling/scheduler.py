"""Flow-matching timestep table (shift 5), few-step schedules per block, and pre-sampled block noise.

Timesteps are floats on the 0..1000 scale. The table follows SPEC §2: ``sigmas = linspace(1, 0, 1001)[:-1]``
shifted by ``s·σ / (1 + (s−1)·σ)``, ``timesteps = 1000·σ'``. Sampling is "predict x0, then re-noise":
``x0 = x_t − σ_t·v`` and ``x = (1 − σ_next)·x0 + σ_next·ε``, with fresh noise ε (Self-Forcing, Krea: distilled
few-step models) or the noise the model predicts (``step_noise = "predicted"``: the flow ODE's Euler step, for
flow-matching models that were not distilled, such as the toy world's).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError

#: named schedules; a list of timesteps (or of lists) is the custom one
SCHEDULES = ("constant", "diagonal", "diagonal-1")
SELF_FORCING_STEPS: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
# Diagonal Distillation released-code lists (raw values; 357.14 is the warp of 100). Snapped to the table.
DIAGONAL_STEPS: tuple[tuple[float, ...], ...] = (
    (1000.0, 933.0, 733.0, 357.14285714285717),
    (1000.0, 933.0, 357.14285714285717),
    (1000.0, 357.14285714285717),
)
#: "diagonal-1": the diagonal's first list for block 0, then one step (t = 1000, the x0 prediction from noise) for
#: every later block — a distilled drafter continuing a cache it did not make (in SDVG block 0 is the target's). Toy
#: world (docs/TOY_WORLD.md, "Sixth sitting"): the student's judge 0.97 × the target's at 5.7× less time a block.
DIAGONAL_ONE_STEPS: tuple[tuple[float, ...], ...] = (DIAGONAL_STEPS[0], (1000.0,))
SNAPPED_LISTS = {"diagonal": DIAGONAL_STEPS, "diagonal-1": DIAGONAL_ONE_STEPS}  # the named per-block lists, snapped


class FlowMatchScheduler:
    """The shifted flow-matching table used by Self-Forcing, Krea and DiagDistill."""

    def __init__(self, shift: float = 5.0, num_train_timesteps: int = 1000) -> None:
        if not (math.isfinite(shift) and shift > 0):
            raise ConfigError(f"Scheduler shift must be a positive finite number, got {shift!r}.")
        if num_train_timesteps < 2:
            raise ConfigError(f"num_train_timesteps must be >= 2, got {num_train_timesteps}.")
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        n = self.num_train_timesteps
        sig = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)[:-1]
        sig = self.shift * sig / (1.0 + (self.shift - 1.0) * sig)
        self.sigmas: torch.Tensor = sig
        self.timesteps: torch.Tensor = sig * n
        # Host-side copies for lookups (ascending for bisect); no device work in the sampling loop.
        self._t_list: list[float] = self.timesteps.tolist()
        self._s_list: list[float] = self.sigmas.tolist()
        self._t_asc: list[float] = self._t_list[::-1]

    def _nearest_index(self, t: float) -> int:
        t = float(t)
        if not math.isfinite(t):
            raise ConfigError(f"Timestep {t!r} is not finite.")
        asc = self._t_asc
        pos = bisect.bisect_left(asc, t)
        if pos <= 0:
            best = 0
        elif pos >= len(asc):
            best = len(asc) - 1
        else:
            best = pos if (asc[pos] - t) < (t - asc[pos - 1]) else pos - 1
        return len(asc) - 1 - best

    def sigma_of(self, t: float) -> float:
        """Sigma of the nearest table entry (t == 0 → 0.0)."""
        if float(t) == 0.0:
            return 0.0
        return self._s_list[self._nearest_index(t)]

    def step_sigma(self, t: float) -> float:
        """σ used for a sampling step at ``t``: the table's, and for ``t == 0`` (Krea's tail step) the smallest table σ
        (≈ 0.00498), as Krea's nearest-entry lookup gives: re-noise to it, call the model at t = 0, convert with it."""
        if float(t) == 0.0:
            return self._s_list[-1]
        return self.sigma_of(t)

    def snap(self, t: float) -> float:
        """Nearest table timestep (0 stays 0)."""
        if float(t) == 0.0:
            return 0.0
        return self._t_list[self._nearest_index(t)]

    def warp(self, steps: Sequence[float]) -> list[float]:
        """Self-Forcing warp: ``timesteps_with_0[N − step]`` ([1000,750,500,250] → [1000,937.5,833.33,625])."""
        n = self.num_train_timesteps
        out: list[float] = []
        for s in steps:
            s = float(s)
            if not math.isfinite(s) or s < 0 or s > n:
                raise ConfigError(f"Raw step {s!r} is outside 0..{n}; use values like 1000,750,500,250.")
            idx = int(round(n - s))
            out.append(0.0 if idx >= n else self._t_list[idx])
        return out


def _validate_list(values: Sequence[float], where: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise ConfigError(f"Step list {where} is empty; give at least one timestep such as 1000.")
    for i, v in enumerate(vals):
        if not math.isfinite(v):
            raise ConfigError(f"Step list {where} contains {v!r}; every timestep must be a finite number.")
        tail = v == 0.0 and i == len(vals) - 1 and i > 0  # Krea's t = 0 tail step (scheduler.step_sigma)
        if not (0.0 < v <= 1000.0 or tail):
            raise ConfigError(f"Step list {where} contains {v}; timesteps must satisfy 0 < t <= 1000 (only the last "
                              "of two or more may be 0: Krea's t = 0 tail step).")
    for a, b in zip(vals, vals[1:], strict=False):
        if not b < a:
            raise ConfigError(
                f"Step list {where} is not strictly decreasing ({a} then {b}) after snapping to the table; "
                "use distinct, decreasing timesteps."
            )
    return vals


def _parse_numbers(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ConfigError(
            f"Cannot parse step schedule {text!r}: use 'constant', 'diagonal', '1000,750,500,250' or a JSON list "
            "of lists."
        ) from exc


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def with_tail_step(schedule: list[list[float]]) -> list[list[float]]:
    """Every block's list with Krea's t = 0 tail step appended (lists that already end at 0 are kept)."""
    return [row if row and row[-1] == 0.0 else [*row, 0.0] for row in schedule]


def build_step_schedule(spec, num_blocks: int, scheduler: FlowMatchScheduler) -> list[list[float]]:
    """Per-block timestep lists. ``spec``: "constant" | "diagonal" | "diagonal-1" | "1000,750,500,250" (raw, warped)
    | JSON / list of lists (used as given after snapping; the last list repeats). A final 0 in a list is Krea's
    t = 0 tail step (``"1000,750,500,250,0"`` is Krea's 5-step schedule)."""
    lists = distinct_step_lists(spec, num_blocks, scheduler)
    return [list(lists[min(b, len(lists) - 1)]) for b in range(int(num_blocks))]


def distinct_step_lists(spec, num_blocks: int, scheduler: FlowMatchScheduler) -> list[list[float]]:
    """The lists of :func:`build_step_schedule` before the last one repeats for later blocks: every check, in time
    that does not grow with ``num_blocks``."""
    if int(num_blocks) < 1:
        raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}.")
    num_blocks = int(num_blocks)
    lists: list[list[float]]
    if isinstance(spec, str):
        text = spec.strip()
        low = text.lower()
        if low == "constant":
            lists = [scheduler.warp(SELF_FORCING_STEPS)]
        elif low in SNAPPED_LISTS:
            lists = [[scheduler.snap(v) for v in row] for row in SNAPPED_LISTS[low]]
        elif text.startswith("["):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"Step schedule {text!r} is not valid JSON: {exc.msg}.") from exc
            return distinct_step_lists(parsed, num_blocks, scheduler)
        elif text:
            raw = _validate_list(_parse_numbers(text), repr(text))
            lists = [scheduler.warp(raw)]
        else:
            raise ConfigError(f"Step schedule is empty; use one of {', '.join(SCHEDULES)} or a list like 1000,750,500,250.")
    elif isinstance(spec, Sequence) and not isinstance(spec, (bytes, bytearray)):
        if not spec:
            raise ConfigError("Step schedule list is empty; give at least one list of timesteps.")
        rows = [spec] if all(_is_number(v) for v in spec) else list(spec)
        if len(rows) > num_blocks:
            raise ConfigError(
                f"Step schedule has {len(rows)} per-block lists but the video has {num_blocks} block(s); give at most "
                "one list per block (the last list repeats for later blocks)."
            )
        lists = []
        for i, row in enumerate(rows):
            if not isinstance(row, Sequence) or isinstance(row, (str, bytes)) or not all(_is_number(v) for v in row):
                raise ConfigError(f"Step schedule entry {i} ({row!r}) must be a list of numbers.")
            _validate_list(row, f"#{i}")
            lists.append([scheduler.snap(v) for v in row])
    else:
        raise ConfigError(f"Unsupported step schedule {spec!r}; use a string or a list of lists.")
    return [_validate_list(row, f"for block {b}") for b, row in enumerate(lists)]  # each list once, not per block


@dataclass
class BlockNoise:
    """The initial noise of a block and the re-noise tensors between steps (len == num_steps − 1)."""

    initial: torch.Tensor
    renoise: list[torch.Tensor]


def block_seed(seed: int, block: int) -> int:
    """Deterministic 63-bit seed derived from (seed, block)."""
    digest = hashlib.sha256(f"sdvg-block-noise:{int(seed)}:{int(block)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_block_noise(
    seed: int, block: int, shape, num_steps: int, *, device=None, dtype: torch.dtype = torch.float32
) -> BlockNoise:
    """Independent CPU generator per (seed, block): initial first, then renoise[0..n-2], then to device/dtype."""
    if int(num_steps) < 1:
        raise ConfigError(f"num_steps must be >= 1, got {num_steps}.")
    if int(block) < 0:
        raise ConfigError(f"Block index must be >= 0, got {block}.")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(block_seed(seed, block))
    shape = tuple(int(s) for s in shape)
    initial = torch.randn(shape, generator=gen, dtype=torch.float32)
    renoise = [torch.randn(shape, generator=gen, dtype=torch.float32) for _ in range(int(num_steps) - 1)]
    return BlockNoise(
        initial=initial.to(device=device, dtype=dtype),
        renoise=[r.to(device=device, dtype=dtype) for r in renoise],
    )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def to_x0(x_t: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x0 = x_t − σ·v`` computed in float32 or higher, cast back to ``x_t.dtype``."""
    ct = _compute_dtype(x_t.dtype)
    return (x_t.to(ct) - float(sigma) * v.to(ct)).to(x_t.dtype)


def to_eps(x_t: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """The noise the flow prediction implies, ``ε = x_t + (1 − σ)·v`` (float32 or higher, cast back): re-noising the x0
    prediction with it is one Euler step of the flow ODE, ``x_t + (σ_next − σ)·v`` (``step_noise = "predicted"``)."""
    ct = _compute_dtype(x_t.dtype)
    return (x_t.to(ct) + (1.0 - float(sigma)) * v.to(ct)).to(x_t.dtype)


STEP_NOISES = ("fresh", "predicted")


def renoise(x0: torch.Tensor, eps: torch.Tensor, sigma_next: float) -> torch.Tensor:
    """``x = (1 − σ)·x0 + σ·ε`` computed in float32 or higher, cast back to ``x0.dtype``."""
    ct = _compute_dtype(x0.dtype)
    s = float(sigma_next)
    return ((1.0 - s) * x0.to(ct) + s * eps.to(ct)).to(x0.dtype)


class NoiseBank:
    """A run's block noise: sampled once per block and moved once per (device, dtype), so the drafter and a
    rejecting target get exactly the same ``z_b`` and ``ε_b,*`` (SPEC §1 step 5)."""

    def __init__(self, seed: int, block_shape: tuple[int, ...], schedule: Sequence[Sequence[float]]) -> None:
        self.seed = seed
        self.block_shape = block_shape
        self.schedule = schedule
        self._noise: dict[tuple[int, torch.device, torch.dtype], BlockNoise] = {}

    def get(self, block: int, device: torch.device, dtype: torch.dtype) -> BlockNoise:
        key = (block, device, dtype)
        if key not in self._noise:
            # keep the previous block too: pipelined drafting of b + 1 may be followed by the target redoing b
            self._noise = {k: v for k, v in self._noise.items() if k[0] >= block - 1}
            self._noise[key] = sample_block_noise(
                self.seed, block, self.block_shape, len(self.schedule[block]), device=device, dtype=dtype
            )
        return self._noise[key]
