"""A copy of a patch latent file with per-channel latent statistics: each channel's std measured on renders.

    python bench/toy_whiten_vae.py --out out/white_vae.safetensors            # from the committed VAE, 512 clips

The committed patch latent model scales all 16 channels by one factor, so its first component (the object's mean
brightness against the background) has std ≈ 4 and the components that carry corners std 0.09–0.4: under unit
noise those are drowned from σ ≈ 0.2 and weigh little in the DiTs' MSE. The copy keeps the bases (the same
pixels round-trip) and sets ``latents_std`` per channel (``patch_vae.channel_variances`` on seeded renders of the
training captions), as Wan's VAE does. A DiT trained in the old units is carried over with ``bench/
toy_finetune_target.py --vae``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install needed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vae", default=None, help="the patch latent file to copy (default: the committed one)")
    p.add_argument("--out", required=True)
    p.add_argument("--clips", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import torch

    from sdvg.loaders.patch_vae import load_patch_vae, write_patch_vae
    from sdvg.models.patch_vae import channel_variances
    from sdvg.toy import TOY_DIR
    from sdvg.toy.train import FILES
    from sdvg.toy.world import CLIP_FRAMES, render_batch, train_captions

    src = a.vae or TOY_DIR / FILES["vae"]
    tensors = load_patch_vae(src, device="cpu").tensors()
    clips, _ = render_batch(torch.Generator().manual_seed(a.seed), a.clips, CLIP_FRAMES, pool=train_captions())
    std = channel_variances(tensors, clips).sqrt()
    tensors["latents_std"] = std
    note = {"from": str(src), "per_channel_std": {"clips": a.clips, "seed": a.seed, "pool": "train_captions"}}
    write_patch_vae(tensors, a.out, note=note)
    sys.stdout.write(json.dumps({"out": a.out, "latents_std": [round(float(v), 4) for v in std]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
