"""The Diagonal Distillation study at toy scale, one command (CPU, about 1 h on 2 cores: five ~10-minute trainings,
then ~8 minutes of measurements):

    python bench/diagonal_study.py --out out/diagonal_study

1. trains the method and its ablations with ``python -m sdvg train diagonal`` (each in its own process, so each
   ``train.json`` holds that run's own s/iteration and peak memory; resumable: rerun to continue):
   ``diagonal`` (diagonal schedule, diagonal forcing = noisy cache, flow term 0.2), ``no-flow`` (flow weight 0),
   ``clean-cache`` (Self-Forcing's clean re-run instead of diagonal forcing), ``constant`` (4 steps every block),
   ``ode-init`` (the teacher ODE regression alone, no DMD);
2. measures on the toy world's judge (24 captions × 2 sampling seeds, 95 % bootstrap intervals): the teacher (toy
   target, its 10 ODE steps), the undistilled toy drafter on the diagonal schedule (fresh and ODE noise), every
   student on the schedule and cache it was trained with, motion amplitude beside quality;
3. long rollouts to 4× the training length (12 blocks; rolling 9-frame window with 3 sinks), judged on each
   3-block window by its last block;
4. the distilled student as the SDVG drafter for the toy target (``python -m sdvg eval --world toy --drafter
   student.pt --drafter-schedule diagonal --drafter-step-noise fresh --cache noisy``), beside the undistilled toy
   drafter on the same diagonal steps (ODE steps, its best few-step setting);
5. writes ``results.json``, ``table.md`` and ``losses.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS: dict[str, dict] = {
    "diagonal": {},
    "no-flow": {"flow_weight": 0.0},
    "clean-cache": {"cache": "clean"},
    "constant": {"schedule": "constant"},
    "ode-init": {"dmd_weight": 0.0, "flow_weight": 0.0},  # the teacher ODE regression alone
}
LONG_BLOCKS = 12  # 4 x the training length of 3 blocks


def train(out: Path, steps: int, threads: int, only: list[str]) -> None:
    for name in only:
        cfg = {"steps": steps, **VARIANTS[name]}
        (out / name).mkdir(parents=True, exist_ok=True)
        cfg_path = out / name / "config.json"
        cfg_path.write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-m", "sdvg", "train", "diagonal", "--config", str(cfg_path), "--out",
                        str(out / name), "--threads", str(threads)], check=True, env=env)


@functools.lru_cache(maxsize=8)
def _models(drafter: str | None):
    from sdvg.loaders.bundle import load_models
    from sdvg.toy.preset import toy_files

    f = toy_files()
    return load_models(f["target"].parents[1], drafter=drafter or f["drafter"], dit_device="cpu", aux_device="cpu",
                       dtype="fp32", need=("drafter", "target", "vae", "text_encoder"))


def samplings(out: Path, names: list[str]):
    from sdvg.toy.preset import FLOW_DRAFTER_FILE, TOY_DIR
    from sdvg.train.measure import Sampling

    drafter = str(TOY_DIR / FLOW_DRAFTER_FILE)
    rows = [Sampling("teacher (toy target, 10 ODE steps)", None),
            Sampling("undistilled drafter, diagonal, fresh noise", drafter),
            Sampling("undistilled drafter, diagonal, ODE steps", drafter, step_noise="predicted")]
    for name in names:
        v = VARIANTS[name]
        rows.append(Sampling(f"student: {name}", str(out / name / "student.pt"), schedule=v.get("schedule", "diagonal"),
                             cache=v.get("cache", "noisy")))
    return rows


def measure_all(out: Path, names: list[str], n_prompts: int, seeds: list[int]) -> dict:
    from sdvg.toy.preset import toy_prompts
    from sdvg.train.config import load_config
    from sdvg.train.measure import measure, teacher_fidelity

    prompts = toy_prompts(n_prompts)
    short = [measure(_models, s, prompts, seeds) for s in samplings(out, names)]
    for row, s in zip(short, samplings(out, names), strict=True):
        if s.drafter is not None:  # the latent MSE to the teacher's video from the same noise (held-out pairs)
            cfg = load_config(None, schedule=s.schedule, cache=s.cache)
            row.update(teacher_fidelity(s.drafter, cfg, step_noise=s.step_noise))
    long = [measure(_models, s, prompts, seeds[:1], num_blocks=LONG_BLOCKS, per_block=True)
            for s in samplings(out, names) if s.name.startswith(("teacher", "student: diagonal", "student: clean",
                                                                   "undistilled drafter, diagonal, ODE"))]
    return {"short": short, "long": long}


def sdvg_rows(out: Path, n_prompts: int) -> list[dict]:
    """SDVG on the toy target with the distilled student as drafter (diagonal, fresh noise), and the same with the
    undistilled toy drafter on the same diagonal steps (its best few-step setting: ODE steps), noisy cache."""
    from sdvg.cli.commands import main
    from sdvg.toy.preset import FLOW_DRAFTER_FILE, TOY_DIR

    rows = []
    for name, drafter, noise in (("student", out / "diagonal" / "student.pt", "fresh"),
                                 ("undistilled drafter", TOY_DIR / FLOW_DRAFTER_FILE, "predicted")):
        ev = out / f"sdvg_eval_{name.split()[0]}"
        argv = ["eval", "--world", "toy", "--out", str(ev), "--drafter", str(drafter), "--drafter-schedule",
                "diagonal", "--drafter-step-noise", noise, "--methods", "target-only,draft-only,sdvg,random",
                "--no-videos", "--limit", str(n_prompts), "--cache", "noisy"]
        if main(argv) != 0:
            raise SystemExit("eval failed")
        with open(ev / "summary.csv", newline="", encoding="utf-8") as fh:
            rows += [{"drafter": name, **r} for r in csv.DictReader(fh)
                     if not (name != "student" and r["method"] == "target-only")]
    return rows


def training_info(out: Path, names: list[str]) -> dict:
    info = {}
    for name in names:
        t = json.loads((out / name / "train.json").read_text(encoding="utf-8"))
        info[name] = {"steps": t["steps"], "s_per_iter": t["s_per_iter"], "peak_memory_mb": t["peak_memory_mb"],
                      "losses": t["losses"], "schedule": t["schedule"]}
    return info


def plot_losses(out: Path, info: dict, dashed_key: str = "regression") -> Path:
    """``losses.png``: each run's fake-score loss (solid) and its ``dashed_key`` loss (dashed), moving mean of 25."""
    from sdvg.outputs.plotting import Chart

    colors = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]
    what = {"regression": "teacher regression", "dmd": "generator DMD loss"}.get(dashed_key, dashed_key)
    chart = Chart(900, 420, (70, 40, 700, 370), title=f"Diagonal Distillation (toy): fake-score loss (solid) and "
                  f"{what} (dashed), moving mean of 25")
    series = []
    for (name, t), color in zip(info.items(), colors, strict=False):
        for key, dashed in (("fake", False), (dashed_key, True)):
            pts = t["losses"].get(key, [])
            if pts:
                series.append((name, key, color, dashed, _smooth(pts, 25)[::10]))  # every 10th: dashes show
    loss_axes(chart, [s[4] for s in series])
    for _name, _key, color, dashed, pts in series:
        chart.line(pts, color, dashed=dashed)
    chart.legend((715, 50), [(name, color, "line") for name, color in zip(info, colors, strict=False)])
    return chart.save(out / "losses.png")


def loss_axes(chart, curves: list[list[tuple[float, float]]]) -> None:
    """Range, frame and ticks of a loss-per-iteration chart over ``curves`` (lists of (iteration, loss))."""
    from sdvg.outputs.plotting import nice_range

    xs = [p[0] for pts in curves for p in pts]
    ys = [p[1] for pts in curves for p in pts]
    chart.set_range(nice_range(xs, pad=0.0), nice_range(ys, include=[0.0]))
    chart.frame()
    chart.x_ticks([round(v) for v in _ticks(chart.x_range)], lambda v: f"{v:.0f}", label="iteration")
    chart.y_ticks(_ticks(chart.y_range), lambda v: f"{v:.2f}")


def _ticks(r: tuple[float, float], n: int = 5) -> list[float]:
    return [r[0] + (r[1] - r[0]) * i / n for i in range(n + 1)]


def _smooth(pts: list, k: int) -> list[tuple[float, float]]:
    vals = [v for _, v in pts]
    return [(pts[i][0], sum(vals[max(0, i - k + 1):i + 1]) / len(vals[max(0, i - k + 1):i + 1]))
            for i in range(len(pts))]


def table(res: dict) -> str:
    lines = ["| sampling | judge [95 % CI] | MSE to the teacher [95 % CI] | smooth | motion (mean \\|Δframe\\|) | "
             "s / video |", "|---|---|---|---|---|---|"]
    for r in res["short"]:
        fid = f"{r['mse']:.3f} [{r['mse_lo']:.3f}, {r['mse_hi']:.3f}]" if "mse" in r else "0 (itself)"
        lines.append(f"| {r['name']} | {r['judge']:.3f} [{r['judge_lo']:.3f}, {r['judge_hi']:.3f}] | {fid} | "
                     f"{r['smooth']:.3f} | {r['motion']:.4f} ± {r['motion_sd']:.4f} | {r['s_per_video']:.3f} |")
    lines += ["", "Long rollout (12 blocks = 4× the training length), judge of the 3-block window ending at block:", ""]
    blocks = sorted({int(b) for r in res["long"] for b in r["by_block"]})
    lines.append("| sampling | " + " | ".join(str(b) for b in blocks) + " |")
    lines.append("|---|" + "---|" * len(blocks))
    for r in res["long"]:
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['by_block'][b]:.2f}" for b in blocks) + " |")
    lines += ["", "| training run | iterations | s / iteration | peak RSS (MiB) |", "|---|---|---|---|"]
    for name, t in res["training"].items():
        lines.append(f"| {name} | {t['steps']} | {t['s_per_iter']:.2f} | {t['peak_memory_mb']:.0f} |")
    lines += ["", "| SDVG on the toy target: drafter | method | τ | acceptance | speedup | judge [95 % CI] |",
              "|---|---|---|---|---|---|"]
    for r in res["sdvg"]:
        acc = f"{float(r['acceptance']):.0%}" if r.get("acceptance") else ""
        lines.append(f"| {r['drafter']} | {r['method']} | {r.get('tau', '')} | {acc} | {float(r['speedup']):.2f} | "
                     f"{float(r['judge']):.3f} [{float(r['judge_lo']):.3f}, {float(r['judge_hi']):.3f}] |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/diagonal_study")
    p.add_argument("--steps", type=int, default=600, help="training iterations per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    names = [v for v in args.variants.split(",") if v]
    if not args.skip_train:
        train(out, args.steps, args.threads, names)
    import torch

    torch.set_num_threads(args.threads)
    res = measure_all(out, names, args.prompts, [int(s) for s in args.seeds.split(",")])
    res["training"] = training_info(out, names)
    res["sdvg"] = sdvg_rows(out, args.prompts) if "diagonal" in names else []
    plot_losses(out, res["training"])
    slim = {**res, "training": {k: {kk: vv for kk, vv in v.items() if kk != "losses"}
                                for k, v in res["training"].items()}}
    (out / "results.json").write_text(json.dumps(slim, indent=1) + "\n", encoding="utf-8")
    (out / "table.md").write_text(table(res), encoding="utf-8")
    sys.stdout.write(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
