"""Diagonal Distillation's ablations at toy scale (issue 25, goal 3): the recipe's DMD stage against the same stage
without the flow term, with Self-Forcing's clean cache instead of diagonal forcing, and on the constant 4-step
schedule — each trained from the toy target's weights by ``bench/distill_recipe.py --variant V`` (one training seed
each), then measured here on pairs nothing was chosen on:

    python bench/distill_recipe.py --out out/ablation --dmd-init teacher --dmd-steps 200 --chunk 100 \\
        --dmd-regression 0 --variant V   # V: diagonal (or the committed student), no-flow, clean-cache, constant
    python bench/distill_ablation.py --out out/ablation

For every student (and the undistilled target weights on the diagonal schedule): the judge with its 95 % interval on
the toy world's 72 held-out captions × seeds 9001, 9002 — on the recompute cache SDVG runs a drafter with, and on
the cache it was trained with —, motion amplitude, and the judge on each 3-block window of a 12-block rollout
(4 × the training length, seed 9001, recompute cache: drift); then each variant's paired difference from the recipe
by caption (seeds averaged, bootstrap). Writes ``ablation.json`` and ``ablation.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

SEEDS = [9001, 9002]
LONG_BLOCKS = 12


def students(out: Path) -> dict[str, str]:
    """Each ablation's student file: the ``--variant`` runs' EMA in ``out``; the recipe's is its run there too, or
    else the committed student (the same command and seed, 200 iterations)."""
    from distill_recipe import ABLATIONS

    from sdvg.toy.preset import toy_files

    got = {v: str(run_dir(out, v) / "student.pt") for v in ABLATIONS}
    if not Path(got["diagonal"]).is_file():  # the recipe not retrained beside its ablations: its committed run
        got["diagonal"] = str(toy_files()["drafter"])
    return got


def run_dir(out: Path, variant: str) -> Path:
    from distill_recipe import stage_name

    return out / stage_name("dmd-from-teacher", variant)


def rows_for(name: str, path: str, caps: list[str]) -> dict:
    """One ablation's measurements: as SDVG runs it, as trained, and its long rollout."""
    from diagonal_study import _models
    from distill_recipe import variant_sampling

    from sdvg.train.measure import Sampling, measure

    how = variant_sampling(name)
    sdvg = measure(_models, Sampling(name, path, **{**how, "cache": "recompute"}), caps, SEEDS)
    trained = measure(_models, Sampling(name, path, **how), caps, SEEDS)
    long = measure(_models, Sampling(name, path, **{**how, "cache": "recompute"}), caps, SEEDS[:1],
                   num_blocks=LONG_BLOCKS, per_block=True)
    return {"file": path, "recompute": sdvg, "as_trained": trained, "long": long}


def by_caption(accs: list[float], n_caps: int) -> list[float]:
    """The judge of each caption, averaged over the seeds (``measure`` loops seeds outside captions)."""
    per = [accs[i::n_caps] for i in range(n_caps)]
    return [sum(p) / len(p) for p in per]


def paired(a: list[float], b: list[float], n_caps: int) -> list[float]:
    """Mean of a − b by caption and its bootstrap interval."""
    from sdvg.eval.stats import mean_ci

    return list(mean_ci([x - y for x, y in zip(by_caption(a, n_caps), by_caption(b, n_caps), strict=True)]))


def table(res: dict) -> str:
    head = ("| student | judge, recompute cache (SDVG) | − recipe [paired] | judge, as trained | − recipe [paired] "
            "| motion | 12-block windows 2 / 5 / 8 / 11 |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for name, r in res["rows"].items():
        rc, tr, lg = r["recompute"], r["as_trained"], r["long"]["by_block"]
        d = res["paired"].get(name, {})
        fmt = lambda m: f"{m[0]:+.3f} [{m[1]:+.3f}, {m[2]:+.3f}]" if m else "—"  # noqa: E731
        lines.append(f"| {name} | {rc['judge']:.3f} [{rc['judge_lo']:.3f}, {rc['judge_hi']:.3f}] | "
                     f"{fmt(d.get('recompute'))} | {tr['judge']:.3f} [{tr['judge_lo']:.3f}, {tr['judge_hi']:.3f}] | "
                     f"{fmt(d.get('as_trained'))} | {rc['motion']:.4f} | "
                     + " / ".join(f"{lg[b]:.2f}" for b in (2, 5, 8, 11)) + " |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/ablation")
    ap.add_argument("--captions", type=int, default=72, help="held-out captions (72: all of them)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=FILE", help="another student to measure "
                    "beside the ablations (sampled like the recipe's), e.g. a longer run's export")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from sdvg.toy.preset import toy_files
    from sdvg.toy.world import held_out_captions

    torch.set_num_threads(1)
    out = Path(args.out)
    caps = held_out_captions(args.captions)
    files = students(out)
    missing = [f"{k}: {v}" for k, v in files.items() if not Path(v).is_file()]
    if missing:
        raise SystemExit("train these first (bench/distill_recipe.py --variant): " + "; ".join(missing))
    files["undistilled (target weights, diagonal)"] = str(toy_files()["target"])
    for item in args.extra:
        name, _, path = item.partition("=")
        if not Path(path).is_file():
            raise SystemExit(f"--extra {item}: no such file (give NAME=FILE)")
        files[name] = path
    rows = {}
    for name, path in files.items():
        rows[name] = rows_for(name, path, caps)
        logging.info("%s: %s", name, json.dumps({k: v["judge"] for k, v in rows[name].items() if k != "file"}))
    base = rows["diagonal"]
    res = {"seeds": SEEDS, "captions": len(caps), "rows": rows,
           "paired": {n: {c: paired(r[c]["accuracies"], base[c]["accuracies"], len(caps))
                          for c in ("recompute", "as_trained")} for n, r in rows.items() if n != "diagonal"}}
    trained = [n for n in students(out) if (run_dir(out, n) / "train.json").is_file()]
    if trained:
        from diagonal_study import plot_losses, training_info

        info = training_info(out, [run_dir(out, n).name for n in trained])
        runs = dict(zip(trained, info.values(), strict=True))
        res["training"] = {n: {k: v for k, v in t.items() if k != "losses"} for n, t in runs.items()}
        logging.info("wrote %s", plot_losses(out, runs, dashed_key="dmd"))
    (out / "ablation.json").write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    (out / "ablation.md").write_text(table(res), encoding="utf-8")
    logging.info("wrote %s\n%s", out / "ablation.md", table(res))


if __name__ == "__main__":
    main()
