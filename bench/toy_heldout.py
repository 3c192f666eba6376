"""Target-only (or draft-only) caption accuracy on the toy world's held-out captions, for a DiT file in training.

    python bench/toy_heldout.py --dit out/toy_v2/checkpoints/sdvg_toy_target.safetensors --captions 24 --seeds 0
    python bench/toy_heldout.py --dit NEW.safetensors --against sdvg/toy/models/diffusion_models/sdvg_toy_target.safetensors \
        --captions 72 --seeds 0,1      # and the paired difference NEW − AGAINST by caption
    python bench/toy_heldout.py --dit T --against T --step-noise fresh --against-step-noise predicted \
        --captions 72 --seeds 9001,9002   # a sampler setting of one DiT, paired

A quick check of a checkpoint while the target trains (the full measurement is ``sdvg eval --world toy``): it loads
the VAE and text encoder of ``--models``, the given DiT in the target's role, samples each (held-out caption, seed)
target-only with the toy schedule, and prints the judge's caption accuracy, every attribute, ``judge_all`` and the
chance-corrected shape/direction score, with bootstrap 95 % intervals over captions. With ``--against`` it measures
that DiT on the same (caption, seed) pairs too and adds each metric's paired difference by caption (a caption's seeds
averaged first), with its bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dit", required=True, help="a toy DiT file (target layout or the drafter's .pt)")
    p.add_argument("--models", default=None, help="models tree for VAE and text encoder (default: the committed one)")
    p.add_argument("--captions", type=int, default=24, help="how many held-out captions (spread over all 72)")
    p.add_argument("--seeds", default="0", help="comma list of seeds")
    p.add_argument("--against", default=None, help="a second DiT: also report the paired difference dit − against")
    p.add_argument("--step-noise", default=None, help="fresh | predicted (default: the toy world's, TOY_STEP_NOISE)")
    p.add_argument("--against-step-noise", default=None, help="--against's step noise (default: --step-noise): the "
                   "same DiT against itself measures a sampler setting, paired")
    p.add_argument("--against-models", default=None, help="--against's models tree (default: --models), for a DiT "
                   "trained with another VAE normalisation")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from sdvg.toy import TOY_DIR
    from sdvg.toy.world import held_out_captions

    caps = held_out_captions(a.captions)
    seeds = [int(s) for s in a.seeds.split(",")]
    items = _per_caption(a.dit, a.models or TOY_DIR, caps, seeds, a.step_noise)
    report = {"dit": a.dit, "models": str(a.models or TOY_DIR), "captions": len(caps), "seeds": a.seeds, "step_noise": a.step_noise, **_summary(items)}
    if a.against:
        noise = a.against_step_noise or a.step_noise
        tree = a.against_models or a.models or TOY_DIR
        base = _per_caption(a.against, tree, caps, seeds, noise)
        report["against"] = {"dit": a.against, "models": str(tree), "step_noise": noise, **_summary(base)}
        diffs = [{k: it[k] - b[k] for k in it} for it, b in zip(items, base, strict=True)]
        report["paired_difference"] = _summary(diffs)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


def _per_caption(dit: str, tree, caps: list[str], seeds: list[int], step_noise: str | None = None) -> list[dict]:
    """The judge's metrics of each caption, its seeds averaged (target-only, the toy schedule, ``step_noise`` or the
    toy's)."""
    from sdvg.loaders import load_models
    from sdvg.sampling.router import RouterConfig
    from sdvg.sampling.sampler import SpeculativeSampler
    from sdvg.toy.judge import judge_metric
    from sdvg.toy.sheet import toy_sampler_config

    models = load_models(tree, target=dit, need=("target", "vae", "text_encoder"),
                         dit_device="cpu", aux_device="cpu", dtype="fp32")
    items = []
    for c in caps:
        ms = [judge_metric(SpeculativeSampler(models, RouterConfig(mode="target-only"),
                                              toy_sampler_config(seed=seed, step_noise=step_noise)).run(c).frames.float(), c)
              for seed in seeds]
        items.append({k: sum(m[k] for m in ms) / len(ms) for k in ms[0]})
    return items


def _summary(items: list[dict]) -> dict:
    from sdvg.eval.stats import mean_ci

    return {k: [round(v, 3) for v in mean_ci([it[k] for it in items])] for k in items[0]}


if __name__ == "__main__":
    raise SystemExit(main())
