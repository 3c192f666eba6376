"""Router: modes, thresholds, validation, early exit, JSON safety."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.sampling.router import (
    FORCE_FIRST_REASON,
    FrameScores,
    Router,
    RouterConfig,
    RouteRecord,
    aggregate,
    quantile,
)


def scores_of(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---- validation -----------------------------------------------------------------------------------------------


def test_defaults_validate():
    cfg = RouterConfig().validate()
    assert cfg.mode == "reward" and cfg.tau == -0.7 and cfg.aggregation == "min" and cfg.threshold == "fixed"
    assert cfg.force_reject_first and not cfg.early_exit


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tau": math.nan}, "NaN"),
        ({"q": 0.0}, "quantile"),
        ({"q": 1.0}, "quantile"),
        ({"q": math.nan}, "finite"),
        ({"target_rate": 1.5}, r"\[0, 1\]"),
        ({"random_rate": -0.1}, r"\[0, 1\]"),
        ({"target_rate": math.inf}, "finite"),
        ({"prior_mean": math.nan}, "finite"),
        ({"prior_std": math.inf}, "finite"),
        ({"delta": math.nan}, "finite"),
        ({"delta": -1.0}, "delta"),
        ({"mode": "fast"}, "reward, random, draft-only, target-only"),
        ({"aggregation": "max"}, "min, mean, quantile"),
        ({"threshold": "auto"}, "fixed, target-rate, relative"),
        ({"prior_count": -1}, "prior_count"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"tau": "low"}, "number"),
    ],
)
def test_validation_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        RouterConfig(**kw).validate()
    with pytest.raises(ConfigError):
        Router(RouterConfig(**kw))


def test_infinite_tau_allowed_on_purpose():
    always_reject = Router(RouterConfig(tau=math.inf))
    always_accept = Router(RouterConfig(tau=-math.inf))
    for b in range(1, 5):
        assert always_reject.decide(b, scores_of(100.0, 50.0)).decision == "reject"
        assert always_accept.decide(b, scores_of(-100.0, -50.0)).decision == "accept"


def test_from_dict_refuses_unknown_names():
    with pytest.raises(ConfigError, match="Valid settings: mode, tau"):
        RouterConfig.from_dict({"tua": 0.1})
    assert RouterConfig.from_dict({"tau": -1.0, "mode": "random"}).tau == -1.0


# ---- forced target, modes -------------------------------------------------------------------------------------


def test_block0_forced_and_needs_scores():
    r = Router()
    assert r.forced_target(0) == FORCE_FIRST_REASON
    assert not r.needs_scores(0)
    assert r.forced_target(1) is None and r.needs_scores(1)
    rec = r.decide(0)
    assert rec.decision == "reject" and rec.reason == FORCE_FIRST_REASON and rec.q is None
    r2 = Router(RouterConfig(force_reject_first=False))
    assert r2.forced_target(0) is None and r2.needs_scores(0)


def test_target_only_and_draft_only():
    t = Router(RouterConfig(mode="target-only"))
    for b in range(4):
        assert t.forced_target(b) is not None and not t.needs_scores(b)
        assert t.decide(b).decision == "reject"
    d = Router(RouterConfig(mode="draft-only"))
    for b in range(5):  # the drafter-only baseline drafts block 0 too
        assert d.forced_target(b) is None and not d.needs_scores(b)
        assert d.decide(b).decision == "accept"


def test_fixed_threshold_min_mean_quantile():
    s = scores_of(0.5, -0.8, 0.1, 0.3)
    rec = Router().decide(1, s)
    assert rec.decision == "reject" and rec.q == pytest.approx(-0.8) and rec.tau == -0.7
    assert "< τ=-0.70" in rec.reason and "min of 4 frames" in rec.reason
    assert rec.scores == pytest.approx([0.5, -0.8, 0.1, 0.3])
    rec = Router(RouterConfig(aggregation="mean")).decide(1, s)
    assert rec.decision == "accept" and rec.q == pytest.approx(0.025)
    assert "≥ τ=-0.70" in rec.reason
    rec = Router(RouterConfig(aggregation="quantile", q=0.5)).decide(1, s)
    assert rec.q == pytest.approx(0.2)
    # tie counts as accept (q >= tau)
    assert Router(RouterConfig(tau=0.25)).decide(1, [0.25, 1.0]).decision == "accept"


def test_aggregate_and_quantile_helpers():
    assert aggregate([3.0, 1.0, 2.0], "min") == 1.0
    assert aggregate([3.0, 1.0, 2.0], "mean") == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)  # numpy linear method
    assert quantile([7.0], 0.3) == 7.0


def test_reward_mode_without_scores_is_an_error():
    with pytest.raises(ConfigError, match="scores"):
        Router().decide(1)
    with pytest.raises(ConfigError, match="scores"):
        Router().decide(1, [])


def test_nan_score_rejects():
    rec = Router().decide(1, [0.5, math.nan])
    assert rec.decision == "reject" and "non-finite" in rec.reason
    json.dumps(rec.to_dict(), allow_nan=False)


# ---- random mode ----------------------------------------------------------------------------------------------


def test_random_mode_deterministic_and_rate():
    def run(seed, rate, n=4000):
        r = Router(RouterConfig(mode="random", random_rate=rate, seed=seed))
        assert not r.needs_scores(1)
        return [r.decide(b).decision for b in range(n)]

    a, b = run(3, 0.3), run(3, 0.3)
    assert a == b
    assert a[0] == "reject"  # block 0 forced, no draw
    accepted = sum(d == "accept" for d in a[1:]) / (len(a) - 1)
    assert abs(accepted - 0.3) < 0.03
    assert run(4, 0.3) != a
    # exactly one draw per eligible block: the decisions follow random.Random(seed) directly
    rng = random.Random(3)
    expected = ["reject"] + ["accept" if rng.random() < 0.3 else "reject" for _ in range(3999)]
    assert a == expected
    assert all(d == "accept" for d in run(0, 1.0, 50)[1:])
    assert all(d == "reject" for d in run(0, 0.0, 50))


# ---- target-rate ----------------------------------------------------------------------------------------------


def test_target_rate_prior_then_percentile():
    cfg = RouterConfig(threshold="target-rate", target_rate=0.72, prior_count=5)
    r = Router(cfg)
    prior_thr = statistics.NormalDist(0.566414, 1.070617).inv_cdf(1 - 0.72)
    seen = []
    values = [0.9, -0.2, 1.5, 0.1, 0.7, 2.0, -1.0, 0.4, 0.3, 1.1]
    for i, v in enumerate(values):
        rec = r.decide(i + 1, [v, v + 1.0])
        if i < 5:
            assert rec.tau == pytest.approx(prior_thr)
            assert "prior" in rec.reason
        else:
            assert rec.tau == pytest.approx(quantile(seen, 1 - 0.72))
            assert "past scores" in rec.reason
        assert rec.decision == ("accept" if v >= rec.tau else "reject")
        seen.append(v)
    assert r.history == pytest.approx(values)


def test_target_rate_num_blocks_correction():
    r = Router(RouterConfig(threshold="target-rate", target_rate=0.72, num_blocks=7))
    assert r.effective_rate() == pytest.approx(0.72 * 7 / 6)
    r = Router(RouterConfig(threshold="target-rate", target_rate=0.9, num_blocks=3))
    assert r.effective_rate() == 0.95
    r = Router(RouterConfig(threshold="target-rate", target_rate=0.72))
    assert r.effective_rate() == 0.72


def test_target_rate_tracks_rate_on_stationary_scores():
    rng = random.Random(1)
    r = Router(RouterConfig(threshold="target-rate", target_rate=0.7, prior_mean=0.0, prior_std=1.0))
    decisions = [r.decide(b, [rng.gauss(0, 1)]).accepted for b in range(1, 2001)]
    assert abs(sum(decisions) / len(decisions) - 0.7) < 0.04


# ---- relative -------------------------------------------------------------------------------------------------


def test_relative_mode():
    r = Router(RouterConfig(threshold="relative", delta=0.5))
    assert r.forced_target(0) is not None
    assert r.wants_reference_score(0)
    assert r.observe_reference(0, scores_of(0.4, 0.2, 0.9)) == pytest.approx(0.2)
    assert not r.wants_reference_score(1)
    rec = r.decide(1, [-0.2, 1.0])
    assert rec.decision == "accept" and rec.tau == pytest.approx(-0.3)
    rec = r.decide(2, [-0.4, 1.0])
    assert rec.decision == "reject" and "ref" in rec.reason


def test_relative_without_reference():
    r = Router(RouterConfig(threshold="relative", force_reject_first=False))
    # the target's first block sets the reference even without force_reject_first
    assert "reference" in r.forced_target(0) and r.wants_reference_score(0) and not r.needs_scores(0)
    rec = r.forced_record(0, r.forced_target(0), [0.5, 0.7])
    assert rec.decision == "reject" and rec.q == pytest.approx(0.5) and rec.scores == pytest.approx([0.5, 0.7])
    r.observe_reference(0, [0.5, 0.7])
    assert r.forced_target(1) is None and r.decide(1, [0.1]).decision == "accept"
    # a draft decided without a reference (sampler skipped observe) is rejected, not crashed
    r2 = Router(RouterConfig(threshold="relative", force_reject_first=False))
    rec = r2.threshold_decision(1, [5.0])
    assert rec.decision == "reject" and rec.tau is None and "no reference" in rec.reason


def test_forced_record():
    r = Router()
    rec = r.forced_record(0, FORCE_FIRST_REASON)
    assert rec.decision == "reject" and rec.q is None and rec.scores == [] and rec.reason == FORCE_FIRST_REASON
    assert r.records == [rec]
    assert r.forced_record(0).reason == FORCE_FIRST_REASON


# ---- early exit -----------------------------------------------------------------------------------------------


class CountingChunks:
    def __init__(self, values, size):
        self.values = values
        self.chunks = [torch.tensor(values[i : i + size]) for i in range(0, len(values), size)]
        self.consumed = 0
        self.closed = False
        self.whole = 0  # times every frame was scored in one call

    def scores(self) -> FrameScores:
        """The block's scores for the router: in one call, or chunk by chunk."""
        def score(idx):
            assert idx is None, "no cascade here"
            self.whole += 1
            return torch.tensor(self.values)

        return FrameScores(len(self.values), score, lambda: iter(self))

    def __iter__(self):
        try:
            for c in self.chunks:
                self.consumed += 1
                yield c
        finally:
            self.closed = True


def test_early_exit_same_decisions_as_full_scoring():
    rng = random.Random(0)
    for trial in range(200):
        tau = rng.choice([-0.7, 0.0, -2.5, math.inf, -math.inf])
        values = [rng.gauss(0.3, 1.0) for _ in range(12)]
        size = rng.choice([1, 3, 4, 12])
        full = Router(RouterConfig(tau=tau)).decide(1, values)
        fast_router = Router(RouterConfig(tau=tau, early_exit=True))
        assert fast_router.strategy.exits_early(fast_router.config)
        src = CountingChunks(values, size)
        fast = fast_router.decide(1, src.scores())
        assert fast.decision == full.decision, trial
        assert src.whole == 0  # scored chunk by chunk
        if full.decision == "reject":
            first_bad = next(i for i, v in enumerate(values) if v < tau)
            assert src.consumed == first_bad // size + 1 and src.closed
            assert "early exit" in fast.reason
            assert fast.q < tau
        else:
            assert src.consumed == len(src.chunks)
            assert fast.q == pytest.approx(full.q)


def test_without_early_exit_every_frame_is_scored():
    values = [0.5, -3.0, 0.2, 0.1]
    src = CountingChunks(values, 1)
    rec = Router(RouterConfig(early_exit=False)).decide(1, src.scores())
    assert src.whole == 1 and src.consumed == 0 and rec.q == pytest.approx(-3.0) and rec.decision == "reject"
    assert rec.scores == pytest.approx(values)
    # early exit with an aggregation it cannot decide is refused, not silently ignored
    for bad in ({"aggregation": "mean"}, {"threshold": "target-rate"}, {"mode": "random"}):
        with pytest.raises(ConfigError, match="Early exit .* decides a block only with mode 'reward'"):
            RouterConfig(early_exit=True, **bad).validate()


def test_streaming_forced_block_scores_nothing():
    src = CountingChunks([1.0], 1)
    rec = Router(RouterConfig(early_exit=True)).decide(0, src.scores())
    assert rec.decision == "reject" and src.consumed == 0 and src.whole == 0


# ---- records --------------------------------------------------------------------------------------------------


def test_record_to_dict_json_safe():
    rec = RouteRecord(3, "reject", "x", q=-1.0, scores=[-1.0, 2.0], tau=math.inf, aggregation="min")
    d = rec.to_dict()
    assert d["tau"] == "inf"
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    rec = Router(RouterConfig(tau=-math.inf)).decide(1, [0.1])
    assert rec.to_dict()["tau"] == "-inf"
    json.dumps(RouterConfig(tau=math.inf).to_dict(), allow_nan=False)


def test_acceptance_fraction():
    r = Router(RouterConfig(tau=0.0))
    assert r.acceptance is None
    r.decide(0)
    r.decide(1, [1.0])
    r.decide(2, [-1.0])
    r.decide(3, [2.0])
    assert r.acceptance == pytest.approx(0.5)


# ---- pattern mode ---------------------------------------------------------------------------------------------


def test_pattern_mode_decides_each_drafted_block_by_its_entry():
    cfg = RouterConfig(mode="pattern", pattern=(True, False, True), num_blocks=4).validate()
    router = Router(cfg)
    assert router.forced_target(0) == FORCE_FIRST_REASON and not router.needs_scores(1)
    decisions = [router.decide(b).decision for b in range(1, 4)]
    assert decisions == ["accept", "reject", "accept"]
    assert all(r.q is None and r.scores == [] for r in router.records)


def test_pattern_mode_can_score_drafts_without_changing_the_decision():
    cfg = RouterConfig(mode="pattern", pattern=(False, True), score_drafts=True, num_blocks=3).validate()
    router = Router(cfg)
    assert router.needs_scores(1) and not router.needs_scores(0)
    low = router.decide(1, scores_of(-9.0, -8.0))  # far below any τ, rejected by the pattern anyway
    high = router.decide(2, scores_of(-9.0, 5.0))  # worst frame -9, accepted by the pattern
    assert (low.decision, high.decision) == ("reject", "accept")
    assert high.q == -9.0 and high.scores == [-9.0, 5.0] and high.tau is None


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mode": "pattern"}, "pattern"),
        ({"mode": "pattern", "pattern": "AR"}, "true/false"),
        ({"mode": "pattern", "pattern": (True, 1)}, "true/false"),
        ({"mode": "pattern", "pattern": (True,), "num_blocks": 3}, "2 drafted"),
        ({"mode": "pattern", "pattern": (True, True, True), "num_blocks": 3}, "one entry per drafted block"),
        ({"mode": "reward", "pattern": (True,)}, "only used in mode 'pattern'"),
        ({"mode": "pattern", "pattern": (True,), "threshold": "relative"}, "relative"),
        ({"mode": "pattern", "pattern": (True,), "score_drafts": "yes"}, "true or false"),
    ],
)
def test_pattern_mode_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        RouterConfig(**kw).validate()


def test_pattern_length_counts_block_zero_when_it_is_drafted():
    assert RouterConfig(mode="pattern", pattern=(True,) * 3, num_blocks=3, force_reject_first=False).validate()


def test_score_frames_scores_a_spread_subset_and_decides_on_its_worst():
    from sdvg.sampling.router import spread_frames

    assert spread_frames(12, 4) == [0, 4, 7, 11] and spread_frames(9, 3) == [0, 4, 8] and spread_frames(12, 1) == [6]
    r = Router(RouterConfig(tau=0.0, score_frames=3))
    assert r.scored_frames(12) == [0, 6, 11] and r.scored_frames(3) is None  # k ≥ n: every frame
    assert Router(RouterConfig(tau=0.0)).scored_frames(12) is None
    with pytest.raises(ConfigError, match="score_frames must be a whole number"):
        RouterConfig(score_frames=-1).validate()
    with pytest.raises(ConfigError, match="score_frames .* or cascade"):
        RouterConfig(score_frames=2, cascade=2).validate()
