"""Pure routing logic: accept a drafted block or send it to the target.

No models here; torch is only touched to turn score tensors into floats. Each mode's rules are its strategy's
(``routing.py``); the router holds the state. The run's contract:

1. ``reason = router.forced_target(b)``: when not None the target generates block ``b`` without a draft
   (block 0 with ``force_reject_first`` in ``reward``/``random``/``pattern`` mode; every block in ``target-only``
   mode; never in ``draft-only`` mode, the drafter-only baseline; under a relative threshold, a block that sets a
   reference: the first, and each prompt switch given as ``anchors``).
2. Otherwise draft and decode, and call the one decision entry point ``router.decide(b, FrameScores(...))``: the
   strategy scores as far as it needs (every frame; a cascade's subset first; chunk by chunk up to the first frame
   below τ with early exit; nothing in modes that do not score). ``decide(b, values)`` takes scores already made.
3. After the target produced a block (forced or rejected) and ``router.wants_reference_score(b)``, score the
   target's frames and call ``router.observe_reference(b, scores)`` (``relative`` threshold only).

Threshold rules (``q`` is the aggregated block score, accept iff ``q >= threshold``):

* ``fixed``: threshold = ``tau``. ``tau = +inf`` always rejects, ``tau = -inf`` always accepts (allowed on purpose).
* ``target-rate``: the authors' running percentile. With ``eff = min(0.95, rate * N / (N - 1))`` when the number
  of blocks ``N`` is known and block 0 is force-rejected (else ``eff = rate``), the threshold is the empirical
  ``1 - eff`` quantile (linear interpolation) of the aggregated scores of all *earlier* drafted blocks; while fewer
  than ``prior_count`` are known it is the Gaussian prior quantile ``prior_mean + prior_std * Phi^-1(1 - eff)``.
* ``relative``: threshold = ``reference - delta`` where the reference is the aggregated score of the target's own
  output for the first target block (block 0). Until a reference is observed, ``forced_target`` sends blocks to
  the target (so block 0 sets it even without ``force_reject_first``); a draft decided without one is rejected.

Cascade scoring (``cascade = k``, SDVG-hybrid; reward mode with min aggregation and a fixed τ, or pattern mode): the
sampler scores ``k`` frames spread over the block first (:meth:`Router.cascade_split`). A frame of the subset below τ
is a safe reject (the block's minimum can only be lower), so the rest is never scored; otherwise the rest is scored
and the block decided on all frames, exactly as full scoring decides it. In pattern mode (the bench) the pattern
stands in for what the subset finds: a rejected block is scored on the subset only (cascade's best case).

Subset scoring (``score_frames = k``): only ``k`` frames spread over the block (:func:`spread_frames`) are ever
scored and aggregated (``min``: the worst *scored* frame); unlike cascade it can change decisions (a bad frame
between them goes unseen) and saves scoring on every block. CLI ``--score-frames``, the router node's input.

Modes without a threshold: ``random`` accepts the i-th drafted block when the i-th draw of ``random.Random(seed)``
is below ``random_rate``; ``pattern`` accepts it when ``pattern[i]`` is true (an exact, reproducible acceptance
pattern, e.g. for benchmarks and matched-acceptance baselines). With ``score_drafts`` both still score every draft
(the cost and the scores of a real run, recorded in the report) but decide as before.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..jsonable import to_jsonable
from .routing import (
    AGGREGATIONS,
    FORCE_FIRST_REASON,
    MODES,
    TARGET_ONLY_REASON,
    FrameScores,
    RouteRecord,
    RouterMode,
    Routing,
    aggregate,
    early_exit_scores,
    fmt,
    quantile,
    spread_frames,
    strategy,
    to_float_list,
)

__all__ = ["AGGREGATIONS", "FORCE_FIRST_REASON", "MODES", "TARGET_ONLY_REASON", "THRESHOLDS", "FrameScores",
           "RouteRecord", "Router", "RouterConfig", "RouterMode", "aggregate", "parse_pattern", "quantile",
           "random_pattern", "runs_model", "spread_frames", "to_float_list"]

THRESHOLDS = ("fixed", "target-rate", "relative")
MAX_EFFECTIVE_RATE = 0.95


def runs_model(mode: str, role: str) -> bool:
    """Whether routing mode ``mode`` ever calls the DiT ``role`` ("target" or "drafter")."""
    return strategy(mode).unused_model != role


@dataclass
class RouterConfig:
    mode: RouterMode | str = RouterMode.REWARD
    tau: float = -0.7
    aggregation: str = "min"
    q: float = 0.1  # quantile for aggregation="quantile"
    threshold: str = "fixed"
    target_rate: float = 0.72
    prior_mean: float = 0.566414
    prior_std: float = 1.070617
    prior_count: int = 5
    delta: float = 0.5
    force_reject_first: bool = True
    random_rate: float = 0.5  # acceptance probability in random mode
    seed: int = 0
    early_exit: bool = False
    num_blocks: int | None = None  # known length of the generation (target-rate correction, pattern length)
    pattern: tuple[bool, ...] | None = None  # pattern mode: the decision for the i-th drafted block (True = accept)
    score_drafts: bool = False  # random / pattern mode: score every draft anyway (the decision stays the same)
    cascade: int = 0  # SDVG-hybrid cascade scoring: frames scored first (0 = off), see the module notes
    score_frames: int = 0  # score only this many frames spread over each block (0 = all); see the module notes

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RouterConfig:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"Unknown router setting(s) {unknown}. Valid settings: {', '.join(names)}.")
        return cls(**dict(data)).validate()

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))

    @property
    def strategy(self) -> Routing:
        """The rules of this mode (``routing.py``)."""
        return strategy(self.mode)

    @property
    def drafted_blocks(self) -> int | None:
        """How many blocks get a draft, when the length is known (block 0 is the target's by default)."""
        rules = self.strategy
        if self.num_blocks is None or not rules.drafts:
            return None if self.num_blocks is None else 0
        forced_first = self.force_reject_first and rules.forces_first
        return self.num_blocks - (1 if forced_first else 0)

    def validate(self) -> RouterConfig:
        """Check every setting; raises ConfigError naming the bad value and the valid choices. Returns self."""
        for name, valid in (("mode", MODES), ("aggregation", AGGREGATIONS), ("threshold", THRESHOLDS)):
            value = getattr(self, name)
            if value not in valid:
                raise ConfigError(f"Unknown router {name} {value!r}. Valid: {', '.join(valid)}.")
        self.mode = RouterMode(self.mode)
        if not _is_real(self.tau):
            raise ConfigError(f"Router tau must be a number, got {self.tau!r}.")
        if math.isnan(self.tau):
            raise ConfigError("Router tau is NaN. Use a number; +inf rejects every draft, -inf accepts every draft.")
        for name in ("q", "target_rate", "prior_mean", "prior_std", "delta", "random_rate"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ConfigError(f"Router {name} must be a finite number, got {value!r}.")
        if not 0.0 < self.q < 1.0:
            raise ConfigError(f"Router quantile q must be strictly between 0 and 1, got {self.q}.")
        for name in ("target_rate", "random_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Router {name} must be in [0, 1], got {value}.")
        if self.prior_std < 0:
            raise ConfigError(f"Router prior_std must be >= 0, got {self.prior_std}.")
        if self.delta < 0:
            raise ConfigError(f"Router delta (relative margin) must be >= 0, got {self.delta}.")
        for name in ("prior_count", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"Router {name} must be a non-negative integer, got {value!r}.")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ConfigError(f"Router num_blocks must be a positive integer or None, got {self.num_blocks!r}.")
        for name in ("cascade", "score_frames"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"Router {name} must be a whole number of frames >= 0 (0 = off), got {v!r}.")
        if self.cascade and not self.strategy.cascade_allowed(self):
            raise ConfigError("Cascade scoring is a safe reject only for the worst frame against a fixed τ: use mode "
                              "'reward' with aggregation 'min' and threshold 'fixed' (or the bench's pattern mode).")
        if self.cascade and self.early_exit:
            raise ConfigError("Choose cascade scoring or early exit, not both (both stop scoring at a bad frame).")
        if self.early_exit is True and not self.strategy.exits_early(self):
            got = (f"mode {RouterMode(self.mode).value!r}" if RouterMode(self.mode) is not RouterMode.REWARD
                   else f"aggregation {self.aggregation!r}" if self.aggregation != "min"
                   else f"threshold {self.threshold!r}")
            raise ConfigError(f"Early exit (stop scoring at the first frame below τ) decides a block only with mode "
                              f"'reward', aggregation 'min' and threshold 'fixed'; got {got}. Turn early exit off, or "
                              "use min with a fixed τ.")
        if self.score_frames and self.cascade:
            raise ConfigError("Choose score_frames (a subset only) or cascade (a subset first, then the rest).")
        for name in ("force_reject_first", "early_exit", "score_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Router {name} must be true or false, got {getattr(self, name)!r}.")
        self._validate_pattern()
        return self

    def _validate_pattern(self) -> None:
        if not self.strategy.uses_pattern:
            if self.pattern is not None:
                raise ConfigError(f"Router pattern is only used in mode 'pattern', not in mode {self.mode!r}.")
            return
        if self.pattern is None or isinstance(self.pattern, str) or not all(isinstance(x, bool) for x in self.pattern):
            raise ConfigError(
                f"Router mode 'pattern' needs pattern = a list of true/false per drafted block, got {self.pattern!r}."
            )
        self.pattern = tuple(self.pattern)
        if self.threshold == "relative":
            raise ConfigError("Router mode 'pattern' decides by the pattern; the relative threshold does not apply.")
        want = self.drafted_blocks
        if want is not None and len(self.pattern) != want:
            raise ConfigError(
                f"Router pattern has {len(self.pattern)} entries but {self.num_blocks} blocks give {want} drafted "
                f"block(s){' (block 0 is the target' + chr(39) + 's)' if self.force_reject_first else ''}: give one "
                "entry per drafted block."
            )

    @property
    def roles_needed(self) -> tuple[str, ...]:
        """The models a run with these settings uses: the DiTs the mode calls, the VAE and the text encoder, and the
        reward model when drafts are scored."""
        dits = tuple(role for role in ("drafter", "target") if runs_model(self.mode, role))
        return (*dits, "vae", "text_encoder", *(("reward",) if self.scores_drafts else ()))

    @property
    def scores_drafts(self) -> bool:
        """Whether every draft is decoded and scored with the reward model."""
        return self.strategy.scores(self)


def parse_pattern(text: str) -> tuple[bool, ...]:
    """``"AARA"`` (A = accept, R = reject; spaces, commas and case ignored) → the pattern of mode ``pattern``."""
    letters = [c for c in str(text).upper() if c not in " ,"]
    bad = sorted({c for c in letters if c not in "AR"})
    if bad or not letters:
        raise ConfigError(
            f"A routing pattern is a string of A (accept) and R (reject), one letter per drafted block, e.g. 'AARA'; "
            f"got {text!r}."
        )
    return tuple(c == "A" for c in letters)


def random_pattern(drafted: int, accepted: int, seed: int) -> tuple[bool, ...]:
    """A pattern that accepts exactly ``accepted`` of ``drafted`` blocks, chosen uniformly at random by ``seed``:
    random routing at an exact acceptance (benchmarks, matched-acceptance baselines)."""
    if not 0 <= accepted <= drafted:
        raise ConfigError(f"Cannot accept {accepted} of {drafted} drafted blocks.")
    chosen = set(random.Random(seed).sample(range(drafted), accepted))
    return tuple(i in chosen for i in range(drafted))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Router:
    """The routing state of one video (the target-rate history, the reference score, the random draws, the records)
    behind one decision entry point, :meth:`decide`; the rules of its mode are its strategy's (``routing.py``)."""

    def __init__(self, config: RouterConfig | None = None, *, shared_history: list[float] | None = None,
                 anchors: frozenset[int] = frozenset()):
        self.config = (config or RouterConfig()).validate()
        self.strategy = self.config.strategy
        self.rng = random.Random(self.config.seed)
        # aggregated scores of drafted blocks, in decision order: this video's, or (``shared_history``, the
        # reference's pooled state) every video's of a run, which the target-rate threshold reads
        self.history: list[float] = [] if shared_history is None else shared_history
        self.reference: float | None = None
        # blocks where a relative threshold takes a new reference (prompt switches: scores against another prompt
        # are not comparable with the old one); each is the target's and its score the new reference
        self._anchors = set(anchors)
        self.records: list[RouteRecord] = []
        self.drafted = 0  # drafted blocks decided so far (the index into the random draws / the pattern)

    # ---- questions the run asks ----------------------------------------------------------------------------
    def forced_target(self, block: int) -> str | None:
        """Why the target makes ``block`` without a draft, or None when it is drafted."""
        return self.strategy.forced(self, block)

    def needs_scores(self, block: int) -> bool:
        return self.config.scores_drafts and self.forced_target(block) is None

    def wants_reference_score(self, block: int) -> bool:
        """Whether the target's output of ``block`` should be scored and observed (a relative threshold's
        reference)."""
        return self.strategy.uses_reference(self.config) and (self.reference is None or block in self._anchors)

    @property
    def acceptance(self) -> float | None:
        """Fraction of decided blocks that were accepted (forced blocks count as rejected); None before any."""
        return sum(r.accepted for r in self.records) / len(self.records) if self.records else None

    def cascade_split(self, n: int) -> tuple[list[int], list[int]] | None:
        """(frames scored first, the rest) for a block of ``n`` frames, or None without cascade scoring. The first
        ``cascade`` frames are spread evenly over the block (4 of 12: 0, 4, 7, 11)."""
        k = self.config.cascade
        if not k or k >= n:
            return None
        first = spread_frames(n, k)
        return first, [i for i in range(n) if i not in set(first)]

    def scored_frames(self, n: int) -> list[int] | None:
        """The frames of a block of ``n`` scored with ``score_frames = k`` (k spread), None for every frame."""
        k = self.config.score_frames
        return spread_frames(n, k) if k and k < n else None

    # ---- observations --------------------------------------------------------------------------------------
    def observe_reference(self, block: int, scores: Any) -> float:
        """Aggregate the target's own output for ``block``; the first one (and the one at each anchor) becomes the
        relative reference."""
        values = to_float_list(scores)
        if not values:
            raise ConfigError(f"observe_reference(block {block}) got no scores.")
        if block in self._anchors:
            self._anchors.discard(block)
            self.reference = None
        value = aggregate(values, self.config.aggregation, self.config.q)
        if self.reference is None and math.isfinite(value):
            self.reference = value
        return value

    # ---- thresholds ----------------------------------------------------------------------------------------
    def effective_rate(self) -> float:
        c = self.config
        n = c.num_blocks
        if n is not None and n > 1 and c.force_reject_first:
            return min(MAX_EFFECTIVE_RATE, c.target_rate * n / (n - 1))
        return c.target_rate

    def current_threshold(self) -> tuple[float | None, str]:
        """(threshold, how it was obtained) for the next drafted block."""
        c = self.config
        if c.threshold == "fixed":
            return c.tau, f"τ={fmt(c.tau)}"
        if c.threshold == "relative":
            if self.reference is None:
                return None, "no reference score yet"
            thr = self.reference - c.delta
            return thr, f"τ=ref {fmt(self.reference)} − δ {fmt(c.delta)} = {fmt(thr)}"
        eff = self.effective_rate()
        if eff >= 1.0:
            return -math.inf, f"τ=-inf (target rate {eff:.2f})"
        if eff <= 0.0:
            return math.inf, f"τ=+inf (target rate {eff:.2f})"
        if len(self.history) < c.prior_count or not self.history:
            if c.prior_std == 0:
                thr = c.prior_mean
            else:
                thr = statistics.NormalDist(c.prior_mean, c.prior_std).inv_cdf(1.0 - eff)
            return thr, f"τ={fmt(thr)} (prior N({c.prior_mean:.3g}, {c.prior_std:.3g}), rate {eff:.2f})"
        thr = quantile(self.history, 1.0 - eff)
        return thr, f"τ={fmt(thr)} ({1 - eff:.2f} quantile of {len(self.history)} past scores, rate {eff:.2f})"

    # ---- decisions -----------------------------------------------------------------------------------------
    def decide(self, block: int, scores: Any = None) -> RouteRecord:
        """The decision for ``block``. ``scores``: its frames' rewards (values), or a :class:`FrameScores` that the
        mode scores as far as it needs (all frames, a cascade's subset first, or chunks up to the first frame below
        τ), or None for modes that do not score. A block the mode forces to the target gets its reject record."""
        forced = self.forced_target(block)
        if forced is not None:
            return self.forced_record(block, forced)
        return self._record(self.strategy.decide(self, block, scores))

    def read_scores(self, scores: FrameScores) -> tuple[list[float], str]:
        """Score a drafted block as this router needs it: (the frame scores to decide on, a note for the reason)."""
        n = scores.count
        subset = self.scored_frames(n)
        if subset is not None:  # score_frames: only these frames are ever scored (early exit has nothing to save)
            return to_float_list(scores.score(subset)), f"; scored frames {','.join(map(str, subset))} of {n}"
        split = self.cascade_split(n)
        if split is not None:  # SDVG-hybrid: a subset of the frames first
            first_idx, rest_idx = split
            first = to_float_list(scores.score(first_idx))
            if self.strategy.cascade_stops(self, first):
                return first, f"; cascade: frames {','.join(map(str, first_idx))} of {n}"
            values = [0.0] * n
            for i, v in zip(first_idx, first, strict=True):
                values[i] = v
            for i, v in zip(rest_idx, to_float_list(scores.score(rest_idx)), strict=True):
                values[i] = v
            return values, ""
        if self.strategy.exits_early(self.config) and scores.chunks is not None:
            return early_exit_scores(scores.chunks(), self.config.tau)
        return to_float_list(scores.score(None)), ""

    def next_drafted(self) -> int:
        """The index of the next drafted block (into the random draws and the pattern); counts it."""
        i, self.drafted = self.drafted, self.drafted + 1
        return i

    def _record(self, rec: RouteRecord) -> RouteRecord:
        self.records.append(rec)
        return rec

    def forced_record(self, block: int, reason: str | None = None, scores: Any = None) -> RouteRecord:
        """The reject record of a block the target generated without a draft; ``scores`` (optional) are the
        target output's frame scores (e.g. the relative reference), kept for the report."""
        values = to_float_list(scores)
        q = aggregate(values, self.config.aggregation, self.config.q) if values else None
        reason = reason or self.forced_target(block) or "target generates this block"
        agg = self.config.aggregation if values else None
        return self._record(RouteRecord(block, "reject", reason, q=q, scores=values, tau=None, aggregation=agg))

    def fault_record(self, block: int, reason: str) -> RouteRecord:
        """Reject a draft that cannot be verified (e.g. non-finite latents); it takes its drafted-block slot, so the
        random draws and a pattern stay aligned with the blocks."""
        self.strategy.on_fault(self)
        return self._record(RouteRecord(block, "reject", reason))

    def threshold_decision(self, block: int, values: list[float], *, note: str = "") -> RouteRecord:
        """Accept iff the aggregated score reaches the threshold in force (a NaN frame rejects)."""
        c = self.config
        agg_text = "min" if c.aggregation == "min" else ("mean" if c.aggregation == "mean" else f"q{c.q:g}")
        desc = f"{agg_text} of {len(values)} frames{note}"
        if any(math.isnan(v) for v in values):
            return RouteRecord(block, "reject", f"non-finite frame score ({desc})", math.nan, values, None,
                               c.aggregation)  # fmt: skip
        q = aggregate(values, c.aggregation, c.q)
        thr, how = self.current_threshold()
        self.history.append(q)
        if thr is None:
            return RouteRecord(block, "reject", f"q={fmt(q)}, {how} ({desc})", q, values, None, c.aggregation)
        ok = q >= thr
        reason = f"q={fmt(q)} {'≥' if ok else '<'} {how} ({desc})"
        return RouteRecord(block, "accept" if ok else "reject", reason, q, values, thr, c.aggregation)
