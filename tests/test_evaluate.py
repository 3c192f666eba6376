"""`python -m sdvg eval` on the tiny models: rows, resume without duplicates, CSV/summary/plot, metric hook."""

from __future__ import annotations

import csv
import json
from collections import Counter

import pytest
import torch

from sdvg.cli.commands import main
from sdvg.errors import ConfigError
from sdvg.eval import folder
from sdvg.eval import run as ev
from sdvg.sampling.sampler import SamplerConfig

PROMPTS = ["a red fox running through snow", "a city street at night with neon lights"]
CONFIG = SamplerConfig(num_blocks=2, width=64, height=64)


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def keys(rows):
    return [(r["prompt_id"], r["method"], r["tau"]) for r in rows]


def test_eval_resumes_without_duplicates_and_writes_outputs(tiny_models, tmp_path):
    out = tmp_path / "eval"
    metric = [ev.load_metric("sdvg.eval.run:temporal_flicker")]
    first = ev.evaluate(tiny_models, PROMPTS, out, taus=(-0.5,), sampler_config=CONFIG, metrics=metric, max_rows=3,
                        save_videos=True, warmup=False)
    assert first["written"] == 3 and not first["complete"]
    rows = read_rows(out / ev.RESULTS)
    assert keys(rows) == [("0", "target-only", ""), ("0", "draft-only", ""), ("0", "target0-draft", "")]
    # a crash in the middle of writing a row leaves a partial line: it is dropped on resume
    with (out / ev.RESULTS).open("a", encoding="utf-8") as fh:
        fh.write("0,random,-0.5,half a ro")
    (out / "videos" / ".p0000_random_tau-0.5.tmp.mp4").write_bytes(b"partial")
    second = ev.evaluate(tiny_models, PROMPTS, out, taus=(-0.5,), sampler_config=CONFIG, metrics=metric,
                         save_videos=True, warmup=False)
    assert second["complete"] and second["skipped"] == 3 and second["written"] == 7
    third = ev.evaluate(tiny_models, PROMPTS, out, taus=(-0.5,), sampler_config=CONFIG, metrics=metric,
                        save_videos=True, warmup=False)
    assert third["written"] == 0 and third["complete"]
    rows = read_rows(out / ev.RESULTS)
    assert len(rows) == 10 and max(Counter(keys(rows)).values()) == 1
    assert list(rows[0])[-1] == "m_flicker" and all(r["m_flicker"] for r in rows)
    for r in rows:
        assert (out / r["video"]).is_file()
        assert float(r["ir_min"]) <= float(r["ir_mean"])
    assert not list((out / "videos").glob(".*.tmp.mp4"))
    by = {(r["prompt_id"], r["method"], r["tau"]): r for r in rows}
    for pid in ("0", "1"):
        assert float(by[(pid, "target-only", "")]["speedup"]) == 1.0
        assert by[(pid, "target-only", "")]["pattern"] == "TT"
        assert by[(pid, "draft-only", "")]["pattern"] == "AA"
        assert by[(pid, "target0-draft", "")]["pattern"] == "TA"  # block 0 the target's, the rest drafted
        # random routing at the acceptance the τ run realized on the same prompt
        assert by[(pid, "random", "-0.5")]["accepted"] == by[(pid, "sdvg", "-0.5")]["accepted"]
        assert float(by[(pid, "sdvg", "-0.5")]["ir_delta"]) == pytest.approx(
            float(by[(pid, "sdvg", "-0.5")]["ir_mean"]) - float(by[(pid, "target-only", "")]["ir_mean"]), abs=1e-5)
    summary = read_rows(out / ev.SUMMARY)
    assert {(s["method"], s["tau"]) for s in summary} == {("target-only", ""), ("draft-only", ""), ("sdvg", "-0.5"),
                                                         ("random", "-0.5"), ("target0-draft", "")}
    for s in summary:  # the interval holds the mean (two prompts: the resamples' means bracket it)
        for col in ("speedup", "ir_mean", "ir_delta"):
            assert float(s[col + "_lo"]) <= float(s[col]) + 1e-9 <= float(s[col + "_hi"]) + 2e-9, (s, col)
    assert (out / ev.PARETO).stat().st_size > 0


def test_eval_cli_on_the_tiny_preset_without_videos(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\n" + "\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    out = tmp_path / "cli"
    args = ["eval", "--prompts", str(prompts), "--out", str(out), "--models", str(tiny_dir), "--blocks", "2",
            "--taus=-1", "--methods", "target-only,sdvg", "--no-videos", "--limit", "1"]
    assert main(args) == 0
    assert "sdvg" in capsys.readouterr().out
    rows = read_rows(out / ev.RESULTS)
    assert keys(rows) == [("0", "target-only", ""), ("0", "sdvg", "-1")] and rows[0]["video"] == ""
    assert main(args) == 0
    assert len(read_rows(out / ev.RESULTS)) == 2
    settings = json.loads((out / folder.SETTINGS).read_text(encoding="utf-8"))
    assert settings["models"]["models_dir"] == str(tiny_dir) and settings["sampler"]["num_blocks"] == 2
    capsys.readouterr()
    changed = [a if a != "2" else "3" for a in args]  # --blocks 3 into the same --out: exit 2, nothing loads
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "sampler.num_blocks: 2 there, 3 now" in err and "new --out" in err
    assert len(read_rows(out / ev.RESULTS)) == 2


def test_metric_hook_discovers_columns_and_refuses_a_changed_set(tiny_models, tmp_path):
    calls = []

    def brightness(frames, prompt):
        calls.append((tuple(frames.shape), prompt))
        return {"brightness": float(frames.mean())}

    out = tmp_path / "m"
    ev.evaluate(tiny_models, PROMPTS[:1], out, taus=(), methods=("target-only",), sampler_config=CONFIG,
                metrics=[("x", brightness)], save_videos=False, warmup=False)
    assert calls and calls[0][0][1:] == (64, 64, 3) and calls[0][1] == PROMPTS[0]
    assert "m_brightness" in read_rows(out / ev.RESULTS)[0]

    def other(frames, prompt):
        return {"sharpness": 1.0}

    with pytest.raises(ConfigError, match="not in"):
        ev.evaluate(tiny_models, PROMPTS, out, taus=(), methods=("target-only",), sampler_config=CONFIG,
                    metrics=[("y", other)], save_videos=False, warmup=False)
    # the first run's settings are recorded; a resume with others would mix rows into one summary: refused
    settings = json.loads((out / folder.SETTINGS).read_text(encoding="utf-8"))
    assert settings["sampler"]["num_blocks"] == 2 and settings["score_frames"] == 0
    with pytest.raises(ConfigError, match=r"sampler\.num_blocks: 2 there, 3 now"):
        ev.evaluate(tiny_models, PROMPTS, out, taus=(), methods=("target-only",), metrics=[("x", brightness)],
                    sampler_config=SamplerConfig(num_blocks=3, width=64, height=64), save_videos=False, warmup=False)
    with pytest.raises(ConfigError, match="score_frames: 0 there, 1 now"):
        ev.evaluate(tiny_models, PROMPTS, out, taus=(), methods=("target-only",), sampler_config=CONFIG,
                    metrics=[("x", brightness)], save_videos=False, warmup=False, score_frames=1)
    assert len(read_rows(out / ev.RESULTS)) == 1


def test_load_metric_and_inputs():
    label, fn = ev.load_metric("sdvg.eval.run:temporal_flicker")
    assert fn(torch.zeros(3, 4, 4, 3), "p") == {"flicker": 0.0}
    for bad in ("nocolon", "sdvg.eval.run:missing", "sdvg_no_such_module_xyz:f", "sdvg.eval.run:DEFAULT_TAUS"):
        with pytest.raises(ConfigError):
            ev.load_metric(bad)
    with pytest.raises(ConfigError):
        ev.parse_taus("a,b")
    assert ev.plan_rows(1, (-1.0, 0.0), ("target-only", "draft-only", "sdvg", "random")) == [
        (0, "target-only", None), (0, "draft-only", None), (0, "sdvg", -1.0), (0, "sdvg", 0.0),
        (0, "random", -1.0), (0, "random", 0.0)]


def test_sample_prompt_file_is_valid(repo_root):
    prompts = ev.read_prompts(repo_root / "bench" / "prompts_sample.txt")
    assert 8 <= len(prompts) <= 12 and all(len(p) > 30 for p in prompts)


# ---- bad inputs: clear refusals, before any row runs ---------------------------------------------------------------


def test_prompt_file_that_is_not_utf8_says_how_to_fix_it(tmp_path):
    for name, text in (("latin1.txt", "a café at dusk\nune forêt\n"), ("cp1252.txt", "a “quoted” prompt\n")):
        path = tmp_path / name
        path.write_bytes(text.encode("latin-1" if name == "latin1.txt" else "cp1252"))
        with pytest.raises(ConfigError) as err:
            ev.read_prompts(path)
        msg = str(err.value)
        assert f"The prompt file {path} is not UTF-8 text (byte 0x" in msg and "on line 1" in msg, msg
        assert "Save it as UTF-8" in msg and f"iconv -f latin1 -t utf-8 {path}" in msg, msg


def test_prompt_file_with_a_bom_folder_or_broken_link(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffa red fox\n# c\n\nneon city\n".encode())
    assert ev.read_prompts(tmp_path / "bom.txt") == ["a red fox", "neon city"]
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "link.txt").symlink_to(tmp_path / "moved.txt")
    cases = {tmp_path / "dir.txt": "is a folder", tmp_path / "link.txt": f"is a broken symbolic link: it points to "
             f"{tmp_path / 'moved.txt'}", tmp_path / "none.txt": "No prompt file"}
    for path, expected in cases.items():
        with pytest.raises(ConfigError, match="Pass a text file with one prompt per line") as err:
            ev.read_prompts(path)
        assert expected in str(err.value), str(err.value)


class _NoRun:
    """Models whose use would be a bug: every check must fire before a row or a warm-up runs."""

    reward = object()

    @property
    def text_encoder(self):
        raise AssertionError("a row ran")


def test_out_that_is_a_file_is_refused_before_any_row_runs(tmp_path):
    (tmp_path / "results.csv").write_text("x")
    for out, expected in ((tmp_path / "results.csv", f"--out: {tmp_path / 'results.csv'} is a file, not a folder."),
                          (tmp_path / "results.csv" / "sub", f"cannot create the folder {tmp_path / 'results.csv'}")):
        with pytest.raises(ConfigError) as err:
            ev.evaluate(_NoRun(), PROMPTS, out, sampler_config=CONFIG)
        msg = str(err.value)
        assert expected in msg and "pass a new or existing folder you can write to" in msg, msg
    (tmp_path / "runs").symlink_to(tmp_path / "unmounted")
    with pytest.raises(ConfigError, match="runs is a broken symbolic link"):
        ev.check_out_dir(tmp_path / "runs" / "eval")
    assert ev.check_out_dir(tmp_path / "new" / "eval").is_dir()


@pytest.mark.parametrize("max_rows", [0, -3, 2.5, True])
def test_max_rows_below_one_never_means_all(tmp_path, max_rows):
    with pytest.raises(ConfigError, match=rf"--max-rows must be a whole number ≥ 1 \(how many new rows to run\), got "
                                          rf"{max_rows!r}"):
        ev.evaluate(_NoRun(), PROMPTS, tmp_path / "out", sampler_config=CONFIG, max_rows=max_rows)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("limit", [0, -1, 1.5, False])
def test_check_eval_args_refuses_a_limit_below_one(limit):
    with pytest.raises(ConfigError, match=rf"--limit must be a whole number ≥ 1 \(how many prompts to run\), got "
                                          rf"{limit!r}\. Leave it out to run all prompts"):
        ev.check_eval_args(limit=limit, max_rows=3)
    ev.check_eval_args(limit=1, max_rows=None)
    ev.check_eval_args()


@pytest.mark.parametrize("prompts, taus, methods, expected", [
    (PROMPTS, (-1.0,), (), "Nothing to compare: 2 prompt(s), methods []"),
    (PROMPTS, (-1.0,), ("sdvg",), "target-only among them"),
    (PROMPTS, (-1.0,), ("target-only", "fast"), "methods ['target-only', 'fast']"),
    ([], (-1.0,), ("target-only",), "Nothing to compare: 0 prompt(s)"),
    (PROMPTS, (), ("target-only", "sdvg"), "no τ was given"),
])  # fmt: skip
def test_a_plan_with_nothing_to_run_is_refused(tmp_path, prompts, taus, methods, expected):
    with pytest.raises(ConfigError) as err:
        ev.evaluate(_NoRun(), prompts, tmp_path / "out", taus=taus, methods=methods, sampler_config=CONFIG)
    assert expected in str(err.value), str(err.value)


def test_bootstrap_interval_is_seeded_and_covers_the_mean():
    from sdvg.eval.stats import bootstrap_ci, mean_ci, mean_or_none
    from sdvg.eval.summary import summarize

    rng = __import__("random").Random(3)
    values = [rng.gauss(0.5, 1.0) for _ in range(40)]
    lo, hi = bootstrap_ci(values, mean_or_none, seed=1)
    assert (lo, hi) == bootstrap_ci(values, mean_or_none, seed=1) != bootstrap_ci(values, mean_or_none, seed=2)
    se = (sum((v - mean_or_none(values)) ** 2 for v in values) / 39) ** 0.5 / 40 ** 0.5
    assert lo < mean_or_none(values) < hi and 2.5 * se < hi - lo < 5.5 * se  # ≈ ±1.96 standard errors
    assert bootstrap_ci([], mean_or_none) is None and bootstrap_ci([2.0], mean_or_none) == (2.0, 2.0)
    mean, m_lo, m_hi = mean_ci(values, seed=1)  # the same interval, with the mean beside it
    assert (m_lo, m_hi) == (lo, hi) and mean == mean_or_none(values)
    with pytest.raises(ValueError):
        mean_ci([])
    rows = [{"prompt_id": str(i), "method": m, "tau": "", "wall_s": str(w), "acceptance": "", "ir_mean": str(q),
             "ir_min": str(q), "ir_retention": "", "ir_delta": str(q - 1.0)}
            for i in range(20) for m, w, q in (("target-only", 2.0, 1.0), ("draft-only", 1.0 + i / 20, 0.5))]
    draft = next(s for s in summarize(rows) if s["method"] == "draft-only")
    assert draft["speedup_lo"] < draft["speedup"] < draft["speedup_hi"]
    assert draft["ir_mean_lo"] == draft["ir_mean"] == draft["ir_mean_hi"] == 0.5  # no spread, no width
    assert draft["ir_retention"] is None and draft["ir_retention_lo"] is None


def test_eval_ray_without_the_extra_names_it(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        pytest.skip("ray is installed here")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fox\n", encoding="utf-8")
    assert main(["eval", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--ray", "auto"]) == 2
    assert "pip install '.[ray]'" in capsys.readouterr().err


def test_the_reward_rows_score_the_subset_asked_and_a_bad_one_is_refused_first(tmp_path):
    """``score_frames``: the sdvg, refine and sdvg-rate rows score that many frames a block; the other rows score
    nothing to route on; a bad value is refused before any row runs."""
    from argparse import Namespace

    from sdvg.cli.args import score_frames_from_args
    from sdvg.toy import TOY_SCORE_FRAMES

    runner = ev.PromptRunner(_NoRun(), CONFIG, tmp_path, routing=ev.RewardRouting(2, {"prior_mean": 0.0}))
    for method, tau in (("sdvg", -1.0), ("refine", -1.0), ("sdvg-rate", 0.5)):
        assert runner.router(0, method, tau, {}).validate().score_frames == 2, method
    assert runner.router(0, "sdvg-rate", 0.5, {}).prior_mean == 0.0  # the target-rate prior reaches its rows only
    assert runner.router(0, "target-only", None, {}).score_frames == 0
    with pytest.raises(ConfigError, match="score_frames must be a whole number of frames >= 0"):
        ev.evaluate(_NoRun(), PROMPTS, tmp_path / "out", taus=(-1.0,), sampler_config=CONFIG, score_frames=-1)
    assert not (tmp_path / "out").exists()
    assert score_frames_from_args(Namespace(score_frames=None, cascade=0), "toy") == TOY_SCORE_FRAMES
    assert score_frames_from_args(Namespace(score_frames=None, cascade=3), "toy") == 0  # cascade picks its own
    assert score_frames_from_args(Namespace(score_frames=None, cascade=0), None) == 0  # the engine: every frame
    assert score_frames_from_args(Namespace(score_frames=5, cascade=0), "toy") == 5


def test_spearman_ranks_ties_and_refuses_what_has_no_ranks():
    from sdvg.eval.stats import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)  # monotone, not linear
    # ties take their average rank: ranks x = 1, 2.5, 2.5, 4 against y = 1..4 → Pearson of the ranks
    assert spearman([0, 1, 1, 2], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5.0) ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) is None and spearman([1], [2]) is None
    with pytest.raises(ValueError, match="pairs"):
        spearman([1, 2], [1])


def test_a_schedule_with_a_list_per_block_runs_the_warm_up_and_the_rows(tiny_models, tmp_path):
    """A drafter schedule with one list for each of 3 blocks (a short first block's continuation, one step later)
    is valid for the run, so the short warm-up run (2 blocks otherwise) takes as many blocks as it has lists."""
    from dataclasses import replace

    cfg = replace(CONFIG, num_blocks=3, drafter_schedule=[[1000, 750, 500, 250], [1000, 500], [1000]]).validate()
    res = ev.evaluate(tiny_models, PROMPTS[:1], tmp_path / "out", taus=(), methods=("target-only", "draft-only"),
                      sampler_config=cfg, save_videos=False)
    assert res["complete"] and res["written"] == 2
