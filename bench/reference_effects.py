"""Measure what each compatibility switch (sdvg/compat.py) changes on the tiny models: docs/REFERENCE.md's table.

    python bench/reference_effects.py [--blocks 4] [--size 64]

For every switch alone (and the whole reference profile) two prompts run on one sampler (reward routing, target-rate
threshold, so the pooled state has something to pool), against the same runs with our defaults. Printed per switch:
relative RMS of the output frames (the frames both show), the largest change of a draft's worst-frame score, how many
routing decisions flipped and the model forwards. Then the decoder alone against the Wan VAE's full decode.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

import torch

from sdvg.fixtures.tiny import ensure_tiny
from sdvg.loaders.bundle import load_models
from sdvg.sampling.compat import PROFILES, Compat
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPTS = ("a red fox running through snow", "a lighthouse on a cliff at dusk, waves below")


def runs(models, compat: Compat, blocks: int, size: int):
    router = RouterConfig(threshold="target-rate", prior_count=2)
    sampler = SpeculativeSampler(models, router, SamplerConfig(num_blocks=blocks, width=size, height=size,
                                                               compat=compat))
    return [sampler.run(p) for p in PROMPTS]


def compare(base, other) -> str:
    rms, dq, flips, fwd = [], 0.0, 0, [0, 0]
    for a, b in zip(base, other, strict=True):
        fa, fb = a.frames[a.frames.shape[0] - b.frames.shape[0]:], b.frames
        rms.append(((fa - fb).pow(2).mean().sqrt() / fa.pow(2).mean().sqrt()).item())
        for ra, rb in zip(a.blocks, b.blocks, strict=True):
            flips += ra.decision != rb.decision
            if ra.q is not None and rb.q is not None and ra.drafted:
                dq = max(dq, abs(ra.q - rb.q))
        fwd[0] += sum(sum(r.forwards.values()) for r in a.blocks)
        fwd[1] += sum(sum(r.forwards.values()) for r in b.blocks)
    return (f"frames rel. RMS {max(rms):.2e} | max |Δq| {dq:.3f} | decisions flipped {flips} | forwards {fwd[0]} → "
            f"{fwd[1]} | frames {base[0].frames.shape[0]} → {other[0].frames.shape[0]}")


def decoder_vs_full(models, blocks: int) -> str:
    vae = models.vae
    gen = torch.Generator().manual_seed(0)
    lat = [torch.randn(1, 16, 3, 8, 8, generator=gen) for _ in range(blocks)]
    z = vae.denormalize(torch.cat(lat, dim=2))
    full = vae.model.decode(z.to(vae.dtype)).sample[0].float().clamp(-1, 1).add(1).mul(0.5).permute(1, 2, 3, 0)
    out = []
    for variant in ("wan", "krea"):
        vae.reset(decoder=variant)
        frames = torch.cat([vae.decode_block(x) for x in lat])
        err = (frames - full).abs().flatten(1).amax(1)
        first_bad = int((err > 1e-4).nonzero()[0]) if (err > 1e-4).any() else None
        out.append(f"{variant}: max |Δ| vs full decode {err.max().item():.2e} (frames 0-8 {err[:9].max().item():.1e}, "
                   f"first frame off by > 1e-4: {first_bad})")
    vae.reset()
    return "; ".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    root, _ = ensure_tiny()
    base_models = load_models(root, dit_device="cpu", aux_device="cpu", dtype="fp32")
    base = runs(base_models, Compat(), args.blocks, args.size)
    ref = PROFILES["reference"]
    out = sys.stdout
    for f in fields(Compat):
        one = Compat(**{f.name: getattr(ref, f.name)})
        models = base_models
        if f.name == "pt_weights":
            models = load_models(root, dit_device="cpu", aux_device="cpu", dtype="fp32", pt_weights="generator")
        out.write(f"{f.name}={getattr(ref, f.name)!r}: {compare(base, runs(models, one, args.blocks, args.size))}\n")
    ref_models = load_models(root, dit_device="cpu", aux_device="cpu", dtype="fp32", pt_weights="generator")
    out.write(f"reference (all six): {compare(base, runs(ref_models, ref, args.blocks, args.size))}\n")
    out.write(f"decoder, {args.blocks} blocks of 64x64: {decoder_vs_full(base_models, args.blocks)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
