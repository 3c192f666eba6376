"""A drafter smaller than the target (issue 24 goal 2, issue 25 goal 2): the first stage of a student that is
distilled into a *smaller* model than its teacher, which the recipe cannot start on its own (it starts DMD from a
student that already samples, and ODE initialisation hurt at this scale).

1. **Flow init** (this script): a DiT of ``--heads`` × ``--head-dim``, ``--layers`` layers, patch ``--patch`` is
   trained by the toy world's own flow-matching trainer (``sdvg.toy.train``, the drafter stage: the world's training
   captions only, the held-out third never drawn) into a copy of the toy models tree, and exported in Self-Forcing's
   layout (``<out>/tree/diffusion_models/sdvg_toy_drafter.pt``). Resumable: rerun the same command.
2. **DMD from the target** (``bench/distill_recipe.py --dmd-init <that file>``): the toy target is the real score and
   the fake score's initial weights, the small model the generator, on the student's diagonal schedule.

    nohup nice -n 10 env OMP_NUM_THREADS=1 python bench/small_student.py --out out/small > out/small/flow.log 2>&1 &
    nohup nice -n 10 env OMP_NUM_THREADS=1 python bench/distill_recipe.py --out out/small/recipe \\
        --dmd-init out/small/tree/diffusion_models/sdvg_toy_drafter.pt --dmd-regression 0 --chunk 100 &

Measured (2026-12-07, defaults: 4 × 32, 2 layers, FFN 512, patch 2, batch 16, 0.24 s a step on one thread): after
2,250 steps the EMA, sampled on the diagonal 4→3→2 schedule with fresh noise (recompute cache, 72 held-out captions ×
seed 9000), draws no valid video (judge 0.000, smoothness 0.000; ungated accuracy 0.444, object frames 0.50) — a
from-scratch flow model this small does not sample a few-step schedule yet, so the small student of docs/TRAINING.md
("A student smaller than its teacher") starts DMD from the first world's patch-2×2 student instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def small_config(args):
    from sdvg.toy.dit_train import DiTSpec, DiTTrainSettings
    from sdvg.toy.train import ToyTrainConfig

    spec = DiTSpec(heads=args.heads, head_dim=args.head_dim, ffn=args.ffn, layers=args.layers, patch=args.patch)
    settings = DiTTrainSettings(steps=args.steps, batch=args.batch, seed=args.seed, object_weight=args.object_weight)
    return ToyTrainConfig(drafter=spec, drafter_train=settings)


def tree_copy(out: Path) -> Path:
    """A copy of the committed toy models tree without its drafter (the stage trains one into it)."""
    from sdvg.toy import TOY_DIR
    from sdvg.toy.train import FILES

    tree = out / "tree"
    if not tree.is_dir():
        shutil.copytree(TOY_DIR, tree, ignore=shutil.ignore_patterns("*.pt"))
        reward = TOY_DIR / FILES["reward"]
        shutil.copy2(reward, tree / FILES["reward"])
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/small")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--patch", type=int, default=2, help="2: 16 tokens a frame (the target has 64)")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--object-weight", type=float, default=4.0, help="the target's fine-tune weighting (k)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from sdvg.toy.train import train_toy

    torch.set_num_threads(1)
    out = Path(args.out)
    tree = tree_copy(out)
    command = "python bench/small_student.py " + " ".join(sys.argv[1:])
    paths = train_toy(tree, out / "work", config=small_config(args), stages=("drafter",), command=command,
                      progress=lambda row: logging.info("%s", json.dumps(row)) if row.get("step", 0) % 250 == 0 else None)
    logging.info("wrote %s", paths["drafter"])


if __name__ == "__main__":
    main()
