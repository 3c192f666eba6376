"""The eval's projection to the real pair (speedup_real), its target-rate rows and the paired reward − random
statistic."""

from __future__ import annotations

import csv

import pytest

from sdvg.errors import ConfigError
from sdvg.eval import run as ev
from sdvg.eval.paired import paired_differences
from sdvg.eval.real_cost import REAL_COSTS, RealCostTally
from sdvg.sampling.calls import Call
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPTS = ["a red fox running through snow", "a city street at night with neon lights"]
CONFIG = SamplerConfig(num_blocks=3, width=64, height=64)


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_real_costs_price_each_call_kind_by_its_signature():
    c = REAL_COSTS
    assert c.price(Call("target", (3, 3, True))) == pytest.approx(74.0)
    assert c.price(Call("target", (0, 1, True))) == pytest.approx(74.0 / 3)  # a one-frame forward
    assert c.price(Call("drafter", (3, 3, True))) == pytest.approx(9.8)
    assert c.price(Call("decode", (False, 3))) == pytest.approx(29.0)
    assert c.price(Call("score", (12,))) == pytest.approx(0.75)
    assert c.price(Call("encode")) == pytest.approx(1.3)
    assert c.price(Call("setup")) == 0.0  # left out of the projection (documented)
    tally = RealCostTally()
    for call in (Call("target", (3, 3, True)), Call("score", (12,)), Call("score", (12,))):
        tally.call_started(call)
        tally.call_finished(call)
    assert tally.counts == {"target": 1, "score": 2} and tally.total == pytest.approx(74.0 + 1.5)


class _Recorder:
    def __init__(self):
        self.calls = []

    def call_started(self, call):
        pass

    def call_finished(self, call):
        self.calls.append(call)


def test_eval_rows_price_the_calls_they_made_and_sweep_target_rates(tiny_models, tmp_path):
    out = tmp_path / "eval"
    res = ev.evaluate(tiny_models, PROMPTS[:1] * 2, out, taus=(-0.5,), rates=(0.4,), seeds=[0, 1],
                      methods=("target-only", "draft-only", "sdvg", "random", "sdvg-rate", "random-rate"),
                      sampler_config=CONFIG, save_videos=False, warmup=False,
                      rate_router={"prior_mean": 0.0, "prior_std": 1.0})
    assert res["complete"]
    rows = read_rows(out / ev.RESULTS)
    by = {(r["prompt_id"], r["method"], r["tau"]): r for r in rows}
    assert {r["seed"] for r in rows} == {"0", "1"}  # one seed per prompt id
    for pid in ("0", "1"):
        ref = by[(pid, "target-only", "")]
        assert float(ref["speedup_real"]) == 1.0
        # the column is the real-size price of the calls the row made: replay draft-only with a recorder
        rec = _Recorder()
        cfg = SamplerConfig(num_blocks=3, width=64, height=64, seed=int(by[(pid, "draft-only", "")]["seed"]))
        SpeculativeSampler(tiny_models, RouterConfig(mode="draft-only"), cfg).run(PROMPTS[0], observers=(rec,))
        priced = sum(REAL_COSTS.price(c) for c in rec.calls)
        assert float(by[(pid, "draft-only", "")]["real_tmacs"]) == pytest.approx(priced, rel=1e-5)
        assert float(by[(pid, "draft-only", "")]["speedup_real"]) == pytest.approx(
            float(ref["real_tmacs"]) / priced, rel=1e-5)
        assert float(by[(pid, "draft-only", "")]["speedup_real"]) > 3  # 7.5× cheaper forwards, same decodes
        # every row reports its acceptance; random-rate matches sdvg-rate's accepted count on the same prompt
        for m in ("sdvg-rate", "random-rate"):
            assert by[(pid, m, "0.4")]["acceptance"] != ""
        assert by[(pid, "random-rate", "0.4")]["accepted"] == by[(pid, "sdvg-rate", "0.4")]["accepted"]
    summary = {(s["method"], s["tau"]): s for s in read_rows(out / ev.SUMMARY)}
    assert float(summary[("draft-only", "")]["speedup_real"]) > 3
    paired = read_rows(out / "paired.csv")
    assert {(p["method"], p["tau"], p["versus"]) for p in paired} == {("sdvg", "-0.5", "random"),
                                                                     ("sdvg-rate", "0.4", "random-rate")}
    assert all(p["prompts"] == "1" and p["pairs"] == "2" for p in paired)  # two seeds of one prompt: one item


def test_rates_and_seeds_are_checked_before_anything_runs(tiny_models, tmp_path):
    with pytest.raises(ConfigError, match="target rate"):
        ev.evaluate(tiny_models, PROMPTS, tmp_path / "a", methods=("target-only", "sdvg-rate"), taus=(0.1,))
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        ev.evaluate(tiny_models, PROMPTS, tmp_path / "b", methods=("target-only", "sdvg-rate"), taus=(0.1,),
                    rates=(1.0,))
    with pytest.raises(ConfigError, match="one seed per prompt"):
        ev.evaluate(tiny_models, PROMPTS, tmp_path / "c", taus=(0.1,), seeds=[0])
    assert ev.plan_rows(1, (0.1,), ("target-only", "sdvg", "random", "sdvg-rate", "random-rate"), (0.2, 0.6)) == [
        (0, "target-only", None), (0, "sdvg", 0.1), (0, "random", 0.1), (0, "sdvg-rate", 0.2),
        (0, "sdvg-rate", 0.6), (0, "random-rate", 0.2), (0, "random-rate", 0.6)]


def _row(pid, prompt, method, tau, judge, acc="0.5"):
    return {"prompt_id": str(pid), "prompt": prompt, "method": method, "tau": tau, "m_judge": str(judge),
            "acceptance": acc}


def test_paired_difference_averages_seeds_per_prompt_and_bootstraps_prompts():
    rows = []
    # prompt A (two seeds): reward − random = +0.5 and +0.25 → +0.375; prompt B (one seed): −0.25
    for pid, prompt, a, b in ((0, "A", 1.0, 0.5), (1, "A", 0.75, 0.5), (2, "B", 0.25, 0.5)):
        rows += [_row(pid, prompt, "sdvg", "0.3", a), _row(pid, prompt, "random", "0.3", b)]
    rows.append(_row(3, "C", "sdvg", "0.3", 1.0))  # no matched random row: not paired
    (item,) = paired_differences(rows)
    assert (item["method"], item["versus"], item["prompts"], item["pairs"]) == ("sdvg", "random", 2, 3)
    assert item["quality"] == "m_judge"
    assert item["diff"] == pytest.approx((0.375 - 0.25) / 2)
    assert item["diff_lo"] == pytest.approx(-0.25) and item["diff_hi"] == pytest.approx(0.375)  # 2 items: extremes
    assert item["reward"] - item["random"] == pytest.approx(item["diff"])
