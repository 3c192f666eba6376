"""The GPU check's plan and layout (``sdvg/bench/gpu_check.py``): budgets within the one-command limit, at most 8
result files two folders down, every step attempted when one fails or times out, summary.json and the log archive
kept current; the wheel requirement check; and (opt-in, ``SDVG_CPU_SMOKE=1``) the whole ``--cpu-smoke`` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from sdvg.bench import gpu_check as gc
from sdvg.bench.gpu_summary import bench_figures, collect_figures

REPO = Path(__file__).resolve().parent.parent


def test_the_step_table_fits_the_machine():
    assert gc.check_plan() == []
    assert gc.BUDGET_TOTAL_S == sum(s.budget_s for s in gc.STEPS) <= gc.LIMIT_S <= 540
    assert gc.CPU_BUDGET_TOTAL_S == sum(s.cpu_budget_s for s in gc.STEPS) <= gc.LIMIT_S
    assert len(gc.OUT_FILES) <= gc.OUT_MAX_FILES == 8
    assert all("/" not in f for f in gc.OUT_FILES)  # named results sit at the top of $OUT
    for step in gc.STEPS[1:]:  # every step has a GPU and a CPU-smoke command, each writing under {out} or {work}
        for cpu in (False, True):
            argv = step.argv("py", cpu, Path("/o"), Path("/w"))
            assert argv[0] == "py" and len(argv) > 1
            assert all(f"/o/{f}" in argv for f in step.outputs)


def test_check_plan_refuses_over_budget_and_too_many_files():
    big = (*gc.STEPS, gc.Step("extra", 600, 600, ("x",), ("x",), ("a.json", "b.json")))
    problems = gc.check_plan(big)
    assert any("GPU step budgets add up" in p for p in problems) and any("CPU-smoke" in p for p in problems)
    assert any("result files" in p for p in problems)


def test_out_layout_counts_files_and_depth(tmp_path):
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "a" / "b" / "f").write_text("")
    assert gc.out_layout(tmp_path) == {"files": ["a/b/f", "summary.json"], "count": 2, "max_depth": 2, "ok": True}
    (tmp_path / "a" / "b" / "c" / "g").write_text("")
    assert not gc.out_layout(tmp_path)["ok"]


def _steps():
    py = ("-c",)
    return (
        gc.Step("deps", 30, 30, (), ()),
        gc.Step("fails", 20, 20, (), (*py, "import sys; print('boom'); sys.exit(3)")),
        gc.Step("hangs", 2, 2, (), (*py, "import json, time; open('{out}/hang.json','w').write(json.dumps("
                                      "{{'partial': True}})); time.sleep(60)"), ("hang.json",)),
        gc.Step("works", 20, 20, (), (*py, "open('{out}/ok.json','w').write('{{}}'); open('{out}/stray.tmp','w')"),
                ("ok.json",)),
    )


def test_every_step_runs_when_one_fails_or_times_out(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    check = gc.Check(out, work, cpu_smoke=True, wheels=None)
    ok = check.run(steps=_steps())
    assert not ok
    summary = json.loads((out / "summary.json").read_text())
    st = summary["steps"]
    assert st["deps"]["status"] == "ok"  # diffusers imports here
    assert st["fails"]["status"] == "failed" and st["fails"]["rc"] == 3 and "boom" in st["fails"]["error"]
    assert st["hangs"]["status"] == "timeout" and st["hangs"]["seconds"] < 15  # killed at its 2 s budget, not 60 s
    assert st["works"]["status"] == "ok"
    assert summary["finished"] and summary["checks_compare"]["caveat"]
    # what the killed step wrote stays; the stray temp file went to the work folder; logs are in the archive
    assert sorted(p.name for p in out.iterdir()) == ["hang.json", "logs.tar.gz", "ok.json", "summary.json"]
    assert gc.out_layout(out)["ok"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert {"logs/fails.log", "logs/hangs.log", "logs/works.log"} <= set(names)
    assert not any("sdvg-cache" in n for n in names)


def test_missing_diffusers_without_wheels_is_a_clear_failure(tmp_path):
    check = gc.Check(tmp_path / "out", tmp_path / "work", cpu_smoke=True, wheels=tmp_path / "none")
    check.python = sys.executable
    check.env["PYTHONPATH"] = str(tmp_path / "shadow")  # a diffusers that fails to import
    (tmp_path / "shadow" / "diffusers").mkdir(parents=True)
    (tmp_path / "shadow" / "diffusers" / "__init__.py").write_text("raise ImportError('simulated: not on the image')")
    fields = check._install_wheels(60)
    assert fields["status"] == "failed" and "gpu_prepare.sh" in fields["error"]


def test_summary_reads_partial_bench_and_missing_files(tmp_path):
    partial = {"partial": True, "runs_done": {"target-only": [{"wall_s": 1.0, "call_s": {"target": 0.5},
                                                                 "cuda_peak_bytes": 2**30}]}}
    figs = bench_figures(partial)
    assert figs == {"partial": True, "runs_done": {"target-only": {"wall_s": 1.0, "call_s": {"target": 0.5},
                                                                   "cuda_peak_gib": 1.0}}}
    empty = collect_figures(tmp_path, tmp_path, cpu_smoke=True)
    assert empty["bench"] == {} and empty["bit_exact"] == {} and empty["train"] == {}


def _wheel(path: Path, name: str, version: str, requires: list[str]) -> Path:
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_wheel_check_against_the_image(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import check_wheels as cw
    finally:
        sys.path.pop(0)
    image = cw.read_image(REPO / "bench" / "gpu_image_packages.txt")
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and "diffusers" not in image
    _wheel(tmp_path, "diffusers", "0.42.1", ["huggingface-hub<3.0,>=1.32.0", "safetensors>=0.8.0", "filelock",
                                             "importlib_metadata", "pytest; extra == 'test'"])
    _wheel(tmp_path, "importlib_metadata", "8.7.0", ["zipp>=3.20"])
    problems, notes = cw.check(tmp_path, image, "3.12.3")
    assert problems == [] and any("filelock" in n for n in notes)
    _wheel(tmp_path, "needy", "1.0", ["huggingface-hub>=2", "not-there"])
    problems, _ = cw.check(tmp_path, image, "3.12.3")
    assert len(problems) == 2 and any("huggingface-hub is 1.33.0" in p for p in problems)


@pytest.mark.cpu_smoke
@pytest.mark.skipif(os.environ.get("SDVG_CPU_SMOKE") != "1", reason="the whole CPU smoke (~3-4 min): SDVG_CPU_SMOKE=1")
def test_the_whole_cpu_smoke(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), SDVG_GPU_WORK=str(tmp_path / "work"), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu-smoke"], env=env, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert run.returncode == 0, summary["steps"]
    assert summary["elapsed_s"] <= gc.LIMIT_S and summary["out_layout"]["ok"]
    assert all(v["held"] for v in summary["figures"]["bit_exact"].values())
    assert summary["figures"]["bench"]["per_call_s"]["target"] > 0
    assert summary["figures"]["train"]["s_per_iter"] > 0
