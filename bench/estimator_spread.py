"""How much a wall-time estimator's efficiency moves with the passes it happens to get.

Reads a report written by ``python -m sdvg bench --json`` (it keeps every pass's wall and block segments), draws
random subsets of ``--size`` passes and recomputes the sweep rows' efficiency (speedup / the report's bound) with
each estimator:

- ``median``: median whole-run wall;
- ``fastest``: fastest whole run;
- ``segment-median``: Σ over block segments of the median pass;
- ``segment-min``: Σ over block segments of the fastest pass (what the bench reports as ``wall_s``);
- ``paired-sum`` (reports from interleaved passes): median over passes of baseline wall / row wall, the baseline
  being the target-only run interleaved beside the row;
- ``paired-block``: the same pairs compared block segment by block segment (``sdvg.bench.paired_speedup``, what
  the bench reports as ``speedup`` for interleaved passes).

All of them estimate the same thing on a quiet machine; on a shared one they differ in how much of the bursty
interference they let through. Prints, per estimator: mean and standard deviation of the efficiencies over all
draws and rows, and the share of draws whose smallest sweep efficiency is ≥ 0.95.

    python bench/estimator_spread.py bench/results/tiny_cpu_2core.json --size 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sdvg.bench import paired_speedup  # noqa: E402


def _seg(runs: list[list[float]], pick) -> float:
    return sum(pick([r[i] for r in runs]) for i in range(len(runs[0])))


ESTIMATORS = {
    "median": lambda walls, segs: statistics.median(walls),
    "fastest": lambda walls, segs: min(walls),
    "segment-median": lambda walls, segs: _seg(segs, statistics.median),
    "segment-min": lambda walls, segs: _seg(segs, min),
}


def _runs_of(row: dict, idx: list[int], passes: int) -> tuple[list[float], list[list[float]]]:
    """The row's runs in the passes ``idx`` (with interleaving the baseline runs once per group, so several per pass)."""
    per_pass = len(row["wall_all_s"]) // passes
    keep = [i for i in range(len(row["wall_all_s"])) if i // per_pass in idx]
    return [row["wall_all_s"][i] for i in keep], [row["segments_all_s"][i] for i in keep]


def spread(report: dict, size: int, draws: int, seed: int = 0) -> dict[str, dict[str, float]]:
    rows = report["rows"]
    base = next(r for r in rows if r["router"] == "target-only" and r["regime"] == "recompute"
                and r["schedule"] == "constant")
    sweep = [r for r in rows if r["group"] in ("random", "scored")]
    passes = len(report.get("passes") or base["wall_all_s"])
    if not 1 <= size <= passes:
        raise SystemExit(f"--size must be between 1 and the report's {passes} passes.")
    estimators: dict = dict(ESTIMATORS)
    if all(r.get("paired_base_segments_s") for r in sweep):
        estimators["paired-sum"] = "sum"
        estimators["paired-block"] = "block"
    rng = random.Random(seed)
    out = {}
    for name, est in estimators.items():
        effs, mins = [], []
        for _ in range(draws):
            idx = rng.sample(range(passes), size)
            if est == "sum":
                e = [statistics.median(r["paired_speedups"][i] for i in idx) / r["bound"] for r in sweep]
            elif est == "block":
                e = [paired_speedup([r["paired_base_segments_s"][i] for i in idx],
                                    [r["segments_all_s"][i] for i in idx]) / r["bound"] for r in sweep]
            else:
                w0 = est(*_runs_of(base, idx, passes))
                e = [(w0 / est(*_runs_of(r, idx, passes))) / r["bound"] for r in sweep]
            effs += e
            mins.append(min(e))
        out[name] = {"mean": statistics.fmean(effs), "sd": statistics.pstdev(effs),
                     "p_min_ge_095": sum(m >= 0.95 for m in mins) / len(mins)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a bench report JSON")
    p.add_argument("--size", type=int, default=None, help="passes per draw (default: all but two, at least 1)")
    p.add_argument("--draws", type=int, default=300)
    args = p.parse_args(argv)
    with open(args.report, encoding="utf-8") as fh:
        report = json.load(fh)
    passes = len(report.get("passes") or report["rows"][0]["wall_all_s"])
    size = args.size or max(1, passes - 2)
    sys.stdout.write(f"{passes} passes in the report; draws of {size}\n")
    sys.stdout.write(f"{'estimator':16s} {'mean eff':>8s} {'sd':>6s} {'P(min ≥ 0.95)':>14s}\n")
    for name, r in spread(report, size, args.draws).items():
        sys.stdout.write(f"{name:16s} {r['mean']:8.3f} {r['sd']:6.3f} {r['p_min_ge_095']:14.2f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
