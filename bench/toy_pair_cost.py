"""The toy pair's per-block cost ratio and draft-only quality under a drafter schedule (issue 24, goal 2).

    python bench/toy_pair_cost.py --models out/toy_v2 --captions 12 --seeds 0 \
        --drafter-schedule diagonal --drafter-step-noise predicted

For each (held-out caption, seed): target-only (the toy schedule, 10 steps) and draft-only (the drafter under
``--drafter-schedule`` / ``--drafter-step-noise``) in the same process, one thread. Per block it takes the model's
denoise phase (the ``target`` / ``draft`` timings of the block records, cache refills included) and reports the
median over all blocks after block 0 (same positions for both), their ratio, and the judge (caption accuracy, every
attribute, chance-corrected) of both rows with bootstrap 95 % intervals over captions. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def _ci(items: list[dict], key: str) -> list[float]:
    from sdvg.eval.stats import mean_ci

    return [round(v, 3) for v in mean_ci([x[key] for x in items])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="toy models tree (default: the committed one)")
    p.add_argument("--target", default=None, help="a target file replacing the tree's")
    p.add_argument("--drafter", default=None, help="a drafter file replacing the tree's")
    p.add_argument("--captions", type=int, default=12)
    p.add_argument("--seeds", default="0")
    p.add_argument("--drafter-schedule", default=None, help="e.g. diagonal (default: the target's schedule)")
    p.add_argument("--drafter-step-noise", choices=["fresh", "predicted"], default=None)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from sdvg.loaders import load_models
    from sdvg.sampling.router import RouterConfig
    from sdvg.sampling.sampler import SpeculativeSampler
    from sdvg.toy import TOY_DIR
    from sdvg.toy.judge import judge_metric
    from sdvg.toy.sheet import toy_sampler_config
    from sdvg.toy.world import held_out_captions

    files = {k: v for k, v in (("target", a.target), ("drafter", a.drafter)) if v}
    models = load_models(a.models or TOY_DIR, need=("target", "drafter", "vae", "text_encoder"), dit_device="cpu",
                         aux_device="cpu", dtype="fp32", **files)
    caps = held_out_captions(a.captions)
    walls: dict[str, list[float]] = {"target-only": [], "draft-only": []}
    quality: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in caps} for m in walls}
    for seed in (int(s) for s in a.seeds.split(",")):
        base = toy_sampler_config(seed=seed)
        draft_cfg = replace(base, drafter_schedule=a.drafter_schedule,
                            drafter_step_noise=a.drafter_step_noise).validate()
        for c in caps:
            for mode, cfg, phase in (("target-only", base, "target"), ("draft-only", draft_cfg, "draft")):
                res = SpeculativeSampler(models, RouterConfig(mode=mode), cfg).run(c)
                walls[mode] += [b.timings.get(phase, 0.0) + b.timings.get("cache", 0.0) for b in res.blocks[1:]]
                quality[mode][c].append(judge_metric(res.frames.float(), c))
    out = {"captions": len(caps), "seeds": a.seeds, "drafter_schedule": a.drafter_schedule,
           "drafter_step_noise": a.drafter_step_noise}
    med = {m: statistics.median(w) for m, w in walls.items()}
    out["median_block_s"] = {m: round(v, 4) for m, v in med.items()}
    out["block_cost_ratio"] = round(med["target-only"] / med["draft-only"], 2)
    for mode, per in quality.items():
        keys = list(next(iter(per.values()))[0])
        items = [{k: sum(x[k] for x in v) / len(v) for k in keys} for v in per.values()]
        out[mode] = {k: _ci(items, k) for k in ("judge", "judge_all", "judge_shape", "judge_direction",
                                                 "judge_colour", "judge_background", "judge_chance")}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
