"""Target-only (or draft-only) caption accuracy on the toy world's held-out captions, for a DiT file in training.

    python bench/toy_heldout.py --dit out/toy_v2/checkpoints/sdvg_toy_target.safetensors --captions 24 --seeds 0

A quick check of a checkpoint while the target trains (the full measurement is ``sdvg eval --world toy``): it loads
the VAE and text encoder of ``--models``, the given DiT in the target's role, samples each (held-out caption, seed)
target-only with the toy schedule, and prints the judge's caption accuracy, every attribute, ``judge_all`` and the
chance-corrected shape/direction score, with bootstrap 95 % intervals over captions.
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
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from sdvg.eval.stats import mean_ci
    from sdvg.loaders import load_models
    from sdvg.sampling.router import RouterConfig
    from sdvg.sampling.sampler import SpeculativeSampler
    from sdvg.toy import TOY_DIR
    from sdvg.toy.judge import judge_metric
    from sdvg.toy.sheet import toy_sampler_config
    from sdvg.toy.world import held_out_captions

    models = load_models(a.models or TOY_DIR, target=a.dit, need=("target", "vae", "text_encoder"),
                         dit_device="cpu", aux_device="cpu", dtype="fp32")
    caps = held_out_captions(a.captions)
    per_caption: dict[str, list[dict]] = {c: [] for c in caps}
    for seed in (int(s) for s in a.seeds.split(",")):
        for c in caps:
            res = SpeculativeSampler(models, RouterConfig(mode="target-only"), toy_sampler_config(seed=seed)).run(c)
            per_caption[c].append(judge_metric(res.frames.float(), c))
    keys = list(next(iter(per_caption.values()))[0])
    items = [{k: sum(m[k] for m in ms) / len(ms) for k in keys} for ms in per_caption.values()]
    out = {}
    for k in keys:
        out[k] = [round(v, 3) for v in mean_ci([it[k] for it in items])]
    sys.stdout.write(json.dumps({"dit": a.dit, "captions": len(caps), "seeds": a.seeds, **out}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
