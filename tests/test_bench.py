"""`python -m sdvg bench`: cost-model math on synthetic records, exact acceptance patterns, one tiny run, real-size
dry run on meta. No timing thresholds here (CI machines vary); the goals are checked by the bench itself."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sdvg import bench
from sdvg.cli.commands import main
from sdvg.errors import ConfigError
from sdvg.sampling.router import Router, RouterConfig


def measure(calls: list[tuple[str, tuple, float]], wall: float, segments: list[float] | None = None) -> bench.RunMeasure:
    return bench.RunMeasure(wall=wall, busy=sum(c[2] for c in calls), phases={}, per_block=[], decisions=[],
                            produced_by=[], segments=segments or [], calls=calls)


def test_cost_model_prices_calls_by_signature_with_medians():
    # target forwards: block 0 (offset 0) 6 ms, later blocks (offset 3) 10 ms; drafter 1 ms; decode 5 ms; score 2 ms
    def tgt(offset, sec):
        return ("target", (offset, 3, True), sec)

    target_only = [tgt(0, 0.006)] * 4 + [tgt(3, 0.010)] * 5 + [("decode", (True, 3), 0.005), ("decode", (False, 3), 0.005)]
    accept_all = [tgt(0, 0.006)] * 4 + [("drafter", (3, 3, True), 0.001)] * 5 + \
        [("decode", (True, 3), 0.005), ("decode", (False, 3), 0.005), ("score", (12,), 0.002)]
    # one burst: a target forward at offset 3 that took 10× longer does not move the median
    noisy = [tgt(3, 0.100)] + [tgt(3, 0.010)] * 4
    table = bench.CostModel.from_runs([measure(c, 0.0) for c in (target_only, accept_all, noisy)])
    assert table.cost("target", (0, 3, True)) == pytest.approx(0.006)
    assert table.cost("target", (3, 3, True)) == pytest.approx(0.010)
    assert table.by_kind["setup"] is None and table.calls_seen[("target", (0, 3, True))] == 8
    p_to, p_acc = table.predict(target_only), table.predict(accept_all)
    assert p_to == pytest.approx(4 * 0.006 + 5 * 0.010 + 2 * 0.005)
    # priced by signature: accept-all's target calls are the cheap block-0 ones, not the mean of all target calls
    assert p_acc == pytest.approx(4 * 0.006 + 5 * 0.001 + 2 * 0.005 + 0.002)
    # an unseen signature falls back to the kind's median; an unseen kind is an error
    assert table.cost("target", (9, 3, False)) == pytest.approx(0.010)
    with pytest.raises(ConfigError):
        table.cost("setup")
    bound = p_to / p_acc
    # a run with 10 % overhead on top of its model time, against a baseline with none
    speedup = (p_to / 1.0) / (p_acc / 0.9)
    assert speedup / bound == pytest.approx(0.9)
    # the fallback table prices what this one never saw, and its JSON lists only its own calls
    other = bench.CostModel.from_runs([measure([("setup", (), 0.004)], 0.0)])
    merged = table.with_fallback(other)
    assert merged.cost("setup") == pytest.approx(0.004) and merged.cost("score", (12,)) == pytest.approx(0.002)
    assert {e["kind"] for e in merged.as_json()} == {"target", "drafter", "decode", "score"}


def test_paired_speedup_cancels_bursts_that_hit_both_runs_of_a_round():
    # the row's block i is half the baseline's; per pass, a burst slows one round (both runs in it) by ×2–3
    base = [[0.4, 0.4, 0.4], [0.4, 0.4, 0.4], [0.4, 0.4, 0.4]]
    row = [[0.2, 0.2, 0.2], [0.2, 0.2, 0.2], [0.2, 0.2, 0.2]]
    for k in range(3):
        base[k][k] *= 2 + k
        row[k][k] *= 2 + k
    assert bench.paired_speedup(base, row) == pytest.approx(2.0)
    with pytest.raises(ConfigError):
        bench.paired_speedup(base, row[:2])


def test_segment_min_wall_takes_each_segment_from_its_fastest_pass():
    # three passes of a 4-segment run; a burst hits a different segment in each pass
    runs = [measure([], wall=sum(seg), segments=seg) for seg in
            ([0.5, 0.2, 0.2, 0.01], [0.3, 0.4, 0.2, 0.01], [0.3, 0.2, 0.6, 0.01])]
    assert bench.segment_min_wall(runs) == pytest.approx(0.3 + 0.2 + 0.2 + 0.01)
    assert bench.segment_min_wall(runs) <= min(r.wall for r in runs)
    runs[1].segments = runs[1].segments[:2]  # an unfinished run: fall back to the fastest whole run
    assert bench.segment_min_wall(runs) == pytest.approx(min(r.wall for r in runs))


def test_pattern_counts_recompute():
    steps = [4, 4, 4, 4, 4]
    c = bench.pattern_counts([True, False, True, False], steps=steps)
    # block 0: 4 target forwards; each drafted block: 4 steps + 1 refill; two rejects: 2 × (4 + 1) target forwards;
    # blocks 2..4 each re-encode one pixel frame as their first context frame
    assert c == {"target": 4 + 10, "drafter": 4 * 5, "decode": 5 + 2, "score": 4, "encode": 3}
    c = bench.pattern_counts([False, False, False, False], steps=steps, refine_from_step=2, scored=False)
    assert c["target"] == 4 + 4 * (2 + 1) and c["score"] == 0
    with pytest.raises(ConfigError):
        bench.pattern_counts([True], steps=steps)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("level", bench.LEVELS)
def test_level_pattern_is_exact_and_drives_the_pattern_router(n, level):
    pattern = bench.level_pattern(n, level, seed=3)
    assert len(pattern) == n and sum(pattern) == round(level * n)
    assert pattern == bench.level_pattern(n, level, seed=3)  # seeded: the same pattern every pass
    router = Router(RouterConfig(mode="pattern", pattern=pattern, num_blocks=n + 1))
    decisions = [router.decide(b).decision == "accept" for b in range(1, n + 1)]
    assert decisions == list(pattern)


def test_pattern_counts_follow_each_regimes_policy():
    from sdvg.sampling.regimes import CacheConfig

    steps, accept = [4, 3, 2, 2], [True, False, True]
    glob = bench.pattern_counts(accept, steps=steps, policy=CacheConfig("global").policy(), scored=False)
    noisy = bench.pattern_counts(accept, steps=steps, policy=CacheConfig("noisy").policy(), scored=False)
    # global: every committed block gets one clean pass in each model that later needs it
    # (drafter: 0 | 1 | 2 → 3 writes; target: 0, 1 when it redoes block 2 → 2 writes)
    assert glob["drafter"] == 3 + 2 + 2 + 3 and glob["target"] == 4 + 2 + 2
    # noisy: a model's own committed blocks are free, the other model's cost one write each
    # (drafter: 0 | 2 (the target's redo) → 2 writes; target: 1 (an accepted draft) → 1 write)
    assert noisy["drafter"] == 3 + 2 + 2 + 2 and noisy["target"] == 4 + 2 + 1
    assert glob["encode"] == noisy["encode"] == 0 and glob["decode"] == 4 + 1


def test_busy_seconds_is_the_union_of_intervals():
    assert bench.busy_seconds([]) == 0.0
    assert bench.busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert bench.busy_seconds([(3, 4), (0, 1)]) == pytest.approx(2.0)


def test_goals_on_a_synthetic_report():
    def row(name, group, level, wall, eff, ovh, router="scored", per_block=None, regime="recompute"):
        return {"name": name, "group": group, "level": level, "wall_s": wall, "efficiency": eff, "overhead": ovh,
                "router": router, "regime": regime, "schedule": "constant", "per_block_s": per_block or []}

    rows = [
        row("target-only", "baseline", None, 2.0, 1.0, 0.01, router="target-only", per_block=[1, 2, 2, 2, 2, 2, 2]),
        row("scored @75%", "scored", 0.75, 1.0, 0.97, 0.02),
        row("pipelined @75%", "pipelined", 0.75, 0.9, 1.1, 0.02),
        row("target-only noisy", "noisy", None, 1.5, 1.0, 0.01, router="target-only", regime="noisy",
            per_block=[1, 1, 1, 1, 1, 2, 2, 2, 3]),  # grows after the window is full (block 4)
    ]
    g = bench.evaluate_goals({"rows": rows})
    assert g["efficiency_ok"] and g["overhead_ok"] and g["pipelined_ok"]
    assert g["per_block_growth"]["recompute/constant"] == pytest.approx(0.0)
    assert g["flat_ok"] is False  # the noisy row grows
    rows[1]["efficiency"] = 0.9
    assert not bench.evaluate_goals({"rows": rows})["efficiency_ok"]
    # with (paired) speedups the gain comes from them, not from the walls: here pipelined is 5 % behind
    rows[1]["speedup"], rows[2]["speedup"] = 2.0, 1.9
    g = bench.evaluate_goals({"rows": rows})
    assert g["pipelined"]["75%"]["gain"] == pytest.approx(-0.05) and g["pipelined_ok"] is False
    assert g["pipelined"]["75%"]["gain_from_walls"] == pytest.approx(1.0 / 0.9 - 1.0)


def test_bench_cli_tiny_smallest_run_writes_json_with_every_field(tiny_dir, tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--models", str(tiny_dir), "--blocks", "3", "--repeats", "1", "--warmup", "0",
               "--levels", "50", "--only", "baseline,random,scored,pipelined,hybrid,refine,noisy,diagonal",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "target/drafter forward cost ratio" in table
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert report["schema"] == bench.SCHEMA
    assert report["machine"]["torch_threads"] == 1
    assert report["cost_model"]["target_over_drafter_forward"] > 0
    names = [r["name"] for r in report["rows"]]
    assert names[:2] == ["target-only", "draft-only"]
    assert {"random @50%", "scored @50%", "pipelined @50%", "hybrid @50%", "refine@2 @50%", "target-only noisy",
            "scored noisy @50%", "target-only diagonal", "scored diagonal @50%"} <= set(names)
    fields = {"wall_s", "speedup", "bound", "efficiency", "overhead", "acceptance", "phase_s", "calls", "predicted_s",
              "peak_rss_bytes", "cuda_peak_bytes", "kv_cache_bytes", "vae_cache_bytes", "vae_snapshot_bytes",
              "per_block_s", "pattern_ok", "calls_match_model"}
    for r in report["rows"]:
        assert fields <= set(r), r["name"]
        assert r["wall_s"] > 0 and r["bound"] > 0 and 0 <= r["overhead"] < 1
        # the block segments partition each run's wall time exactly
        for wall, segments in zip(r["wall_all_s"], r["segments_all_s"], strict=True):
            assert len(segments) == 3 + 1 and sum(segments) == pytest.approx(wall, rel=1e-9)
        assert r["wall_s"] <= r["wall_min_s"] + 1e-12
        assert r["efficiency_median_wall"] > 0 and r["efficiency_min_wall"] > 0
        assert set(bench.PHASES) <= set(r["phase_s"])
        assert r["peak_rss_bytes"] > 0 and r["vae_cache_bytes"] > 0
        if r["level"] is not None:
            assert r["pattern_ok"], r["name"]
            assert r["acceptance"] == pytest.approx(r["level"])
        if r["calls_match_model"] is not None:
            assert r["calls_match_model"], r["name"]
    # one pass ran every row once, in groups of two rows beside their own target-only run
    groups = report["passes"][0]
    assert all("target-only" in g and len(g) <= 3 for g in groups)
    assert sorted(n for g in groups for n in g if n != "target-only") == sorted(names[1:])
    for r in report["rows"][1:]:
        assert len(r["paired_speedups"]) == 1 and r["speedup"] == pytest.approx(r["paired_speedups"][0])
    assert report["rows"][0]["paired_speedups"] is None
    # the baseline ran beside every group, but one run per pass counts for its own row (like every other row)
    assert report["rows"][0]["repeats"] == 1 and len(report["rows"][0]["wall_all_s"]) == 1
    assert report["settings"]["interleave"] == 2
    recompute = {(e["kind"], tuple(e["signature"])) for e in report["cost_model"]["per_signature_s"]["recompute"]}
    assert ("target", (0, 3, True)) in recompute and ("target", (3, 3, True)) in recompute
    base = report["rows"][0]
    assert base["speedup"] == pytest.approx(1.0) and base["bound"] == pytest.approx(1.0)
    assert set(base["kv_cache_bytes"]) == {"target"}
    assert report["rows"][1]["calls"]["target"] == 0
    assert {"efficiency_ok", "overhead_ok", "flat_ok", "pipelined_ok", "per_block_growth"} <= set(report["goals"])


def test_interleaved_runs_give_the_same_videos_as_runs_alone(tiny_models):
    """Block-by-block interleaving shares the models between live runs (the VAE stream state is swapped around each
    step): every run's frames, latents and decisions must be bit-identical to the same run on its own."""
    s = bench.BenchSettings(blocks=4, repeats=1, warmup=0)
    embeds = tiny_models.text_encoder.encode(s.prompt)
    pattern = bench.level_pattern(3, 1 / 3)
    variants = [bench.Variant("target-only", "target-only"), bench.Variant("scored", "scored", 1 / 3),
                bench.Variant("pipelined", "scored", 1 / 3, pipelined=True),
                bench.Variant("noisy", "random", 1 / 3, regime="noisy")]
    alone = {v.name: bench.run_once(tiny_models, v, s, embeds, pattern) for v in variants}
    live = [bench.LiveRun(tiny_models, v, s, embeds, pattern) for v in variants]
    bench.run_interleaved(live)
    for r in live:
        m_alone, res_alone = alone[r.variant.name]
        assert torch.equal(r.result.frames, res_alone.frames), r.variant.name
        assert torch.equal(r.result.latents, res_alone.latents), r.variant.name
        assert [b.decision for b in r.result.blocks] == [b.decision for b in res_alone.blocks]
        m = r.measure()
        assert m.counts == m_alone.counts  # each run's calls were traced to it, not to its neighbours
        assert len(m.segments) == s.blocks + 1 and m.wall == pytest.approx(sum(m.segments))
    drafted = [b.decision == "accept" for b in live[1].result.blocks if b.drafted]
    assert drafted == list(pattern) and sum(drafted) == 1  # the pattern was forced


def test_bench_with_only_the_baseline_left_runs_it_alone(tiny_dir, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--models", str(tiny_dir), "--blocks", "2", "--repeats", "1", "--warmup", "0",
                 "--only", "target-only", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["target-only"] and report["passes"] == [[["target-only"]]]
    # a misspelt row or group is named, not silently dropped
    assert main(["bench", "--models", str(tiny_dir), "--only", "scored,piplined"]) == 2
    err = capsys.readouterr().err
    assert "'piplined'" in err and "pipelined" in err


def test_real_size_dry_run_builds_on_meta_and_prints_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["bench", "--profile", "real-size", "--dry-run", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memory plan at 832x480" in text and "KV target" in text
    plan = json.loads(out.read_text())["memory_plan"]
    assert 14.0e9 < plan["models"]["target"]["params"] < 14.5e9
    assert 1.3e9 < plan["models"]["drafter"]["params"] < 1.5e9
    assert plan["models"]["target"]["layers"] == 40 and plan["models"]["drafter"]["dim"] == 1536
    # SPEC §2: 14B / 6-frame window ≈ 7.7 GB, 1.3B ≈ 1.7 GB in bf16 (recompute keeps 3 context + 3 block frames)
    assert plan["kv_cache_bytes"]["target"]["recompute"] == pytest.approx(7.7e9, rel=0.01)
    assert plan["kv_cache_bytes"]["drafter"]["recompute"] == pytest.approx(1.72e9, rel=0.01)
    assert plan["vae_cache_bytes"] > 1e9
    # the bf16 KV figures for the 14B at 832x480 (5 blocks): recompute 7.1, noisy 14.3, global 17.9 GiB
    gib, kv = 2**30, plan["kv_cache_bytes"]["target"]
    assert [round(kv[r] / gib, 1) for r in ("recompute", "noisy", "global")] == [7.1, 14.3, 17.9]
    # the 24 GiB card plan: fp8 + target-block offload fits with the recompute cache only; K is the most that fit
    cp = plan["card_plan"]
    assert cp["best"] == "recompute" and not cp["regimes"]["noisy"]["fits"] and not cp["regimes"]["global"]["fits"]
    k = cp["regimes"]["recompute"]["resident_blocks"]
    assert 0 < k < cp["layers"] and cp["settings"]["target_offload_blocks"] == k
    used = sum(cp["fixed"].values()) + cp["regimes"]["recompute"]["kv_bytes"] + k * cp["block_bytes"]
    assert used <= cp["card_bytes"] < used + cp["block_bytes"]
    assert cp["block_bytes"] == pytest.approx(0.327 * gib, rel=0.01)  # one 14B block in fp8 (+ bf16/fp32 norms)
    assert f"--dtype fp8_e4m3fn --target-offload-blocks {k} --cache recompute" in text
    assert main(["bench", "--profile", "real-size", "--dry-run", "--card-gib", "0"]) == 2
    assert "--card-gib must be a positive" in capsys.readouterr().err


def test_real_size_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "--profile", "real-size"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_real_size_model_builder_runs_the_bench_at_tiny_shapes():
    """The real-size code path (random DiTs/VAE/ImageReward built in place) end to end, at tiny shapes on the CPU."""
    from dataclasses import replace

    from sdvg.fixtures.random_models import RealSizeSpec, build_real_size_models
    from sdvg.fixtures.tiny import TINY_DRAFTER_CONFIG, TINY_REWARD_CONFIG, TINY_TARGET_CONFIG, tiny_reward_vocab

    configs = {"drafter": TINY_DRAFTER_CONFIG, "target": TINY_TARGET_CONFIG, "vae_base_dim": 2,
               "reward": replace(TINY_REWARD_CONFIG, vocab_size=len(tiny_reward_vocab()) + 2)}
    spec = RealSizeSpec(dtype=torch.float32)
    device = torch.device("cpu")
    models = build_real_size_models(device, spec, configs=configs)
    s = bench.BenchSettings(profile="real-size", blocks=2, width=32, height=32, repeats=1, warmup=0, levels=(1.0,))
    embeds = torch.randn(1, 8, TINY_DRAFTER_CONFIG["text_dim"])
    variants = [bench.Variant("target-only", "target-only"), bench.Variant("scored @100%", "scored", 1.0)]
    report = bench.run_bench(models, s, device=device, embeds=embeds, variants=variants)
    assert report["settings"]["interleave"] == 0  # real size: every run on its own by default
    assert [r["name"] for r in report["rows"]] == ["target-only", "scored @100%"]
    assert report["rows"][1]["peak_measured"] == "alone" and report["rows"][1]["paired_speedups"] is None
    assert report["rows"][1]["acceptance"] == 1.0 and report["rows"][1]["calls"]["score"] == 1
    plan = bench.memory_plan(models, s)
    assert plan["kv_cache_bytes"]["target"]["recompute"] > 0


def test_estimator_spread_script_on_a_synthetic_bursty_report(tmp_path, capsys, bench_script):
    """bench/estimator_spread.py: with one burst per pass in a different segment, the segment minimum recovers the
    undisturbed walls exactly (efficiency 1 in every draw) while whole-run estimators cannot."""
    mod = bench_script("estimator_spread")

    def runs_of(segs, shift=0):  # one burst per pass, on a different segment each time, ×(1.5…2.5)
        out = []
        for k in range(6):
            s = list(segs)
            s[(k + shift) % len(s)] *= 1.5 + 0.5 * ((k + shift) % 3)
            out.append(s)
        return out

    base_runs = runs_of([0.4] * 4)  # the baseline runs beside the rows: the same bursts as the rows

    def row(name, group, segs):
        runs = runs_of(segs, shift=1 if group == "baseline" else 0)  # the baseline's other runs: other bursts
        return {"name": name, "group": group, "router": "target-only" if group == "baseline" else "random",
                "regime": "recompute", "schedule": "constant", "bound": 1.6 / sum(segs),
                "wall_all_s": [sum(s) for s in runs], "segments_all_s": runs, "paired_base_segments_s": base_runs,
                "paired_speedups": [sum(b) / sum(r) for b, r in zip(base_runs, runs, strict=True)]}

    report = {"rows": [row("target-only", "baseline", [0.4] * 4), row("random @100%", "random", [0.1] * 4),
                       row("random @0%", "random", [0.6] * 4)]}
    out = mod.spread(report, size=4, draws=50)
    # the bursts hit the row and the baseline beside it alike: the paired per-block estimate is exact
    assert out["paired-block"]["mean"] == pytest.approx(1.0) and out["paired-block"]["sd"] < 1e-12
    assert out["segment-min"]["mean"] == pytest.approx(1.0) and out["segment-min"]["sd"] < 1e-12
    assert out["segment-min"]["p_min_ge_095"] == 1.0
    assert out["median"]["sd"] > 0.01 and out["fastest"]["sd"] > 0.01
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert mod.main([str(tmp_path / "r.json"), "--draws", "20"]) == 0
    assert "segment-min" in capsys.readouterr().out


def test_flatness_needs_at_least_four_steady_blocks():
    assert bench.per_block_growth([1.0, 2.0, 2.2], start=1) is None  # two steady blocks: no verdict
    assert bench.per_block_growth([1.0, 2.0, 2.0, 3.0, 3.0], start=1) == pytest.approx(0.5)


def test_paper_ratio_profile_sizing_and_rows():
    """The paper-ratio preset's DiTs: a target forward ≈ 10 drafter forwards by weight MACs per token at 32×32 is not
    what sets the ratio on a CPU (per-op overhead does), so this only checks the sizing the profile documents and
    that its rows are the scored and hybrid sweeps; `bench --profile paper-ratio` measures the ratios."""
    from sdvg.bench.cli import settings_from_args
    from sdvg.cli.commands import build_parser
    from sdvg.fixtures.paper_ratio import PAPER_DRAFTER_CONFIG, PAPER_TARGET_CONFIG, REAL_RATIOS
    from sdvg.loaders.wan_keys import original_key_shapes

    def params(cfg):
        return sum(math.prod(s) for s in original_key_shapes(cfg).values())

    assert 12 < params(PAPER_TARGET_CONFIG) / params(PAPER_DRAFTER_CONFIG) < 20  # 16× the weights; time ≈ 10×
    assert PAPER_DRAFTER_CONFIG["text_dim"] == PAPER_TARGET_CONFIG["text_dim"]
    assert REAL_RATIOS["target/drafter forward"] == 10.0
    s = settings_from_args(build_parser().parse_args(["bench", "--profile", "paper-ratio"]))
    assert (s.width, s.height, s.blocks) == (32, 32, 9)
    groups = {v.group for v in bench.default_variants("paper-ratio", s.levels)}
    assert groups == {"baseline", "scored", "hybrid"}


def test_the_card_plan_with_a_bf16_drafter_and_a_gguf_target(tmp_path, capsys):
    """The README's 24 GB recipes: --target-dtype fp8_e4m3fn --drafter-dtype bf16, and a Q4_K GGUF target."""
    assert main(["bench", "--profile", "real-size", "--dry-run", "--card-drafter-dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "drafter weights (bf16)                       2.65 GiB" in text
    assert "--target-dtype fp8_e4m3fn --drafter-dtype bf16 --target-offload-blocks 5 --cache recompute" in text
    assert main(["bench", "--profile", "real-size", "--dry-run", "--card-drafter-dtype", "bf16", "--card-target",
                 "Q4_K"]) == 0
    text = capsys.readouterr().out
    assert "40 target blocks of 0.184 GiB each" in text and "12 of 40 target blocks resident" in text
