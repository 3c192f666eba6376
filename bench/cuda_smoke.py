"""CUDA smoke test of the engine on the tiny models (run by bench/gpu_check.sh; ``--device cpu``: the same checks on
the CPU, as ``gpu_check.sh --cpu-smoke`` runs them).

Checks, each recorded in the JSON written to --out (rewritten after every check, so a killed run keeps the ones done):
1. reject-all (reward router, τ = +inf) is bit-identical to target-only (latents and frames), per regime;
2. pipelined verification (side CUDA stream; a thread on the CPU) gives the same video as plain verification;
3. a bf16 forward of both DiTs and a bf16 generation are finite.

What "bit-identical" compares: two runs in one process, on one device, that make the same target calls in the same
order on tensors of the same shapes (reject-all drafts and scores too, but discards all of it). They are equal bit
for bit when every kernel is deterministic for a given shape: true of the CPU kernels, and on CUDA of SDPA's forward
kernels and of cuBLAS once ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set (gpu_check.sh sets it; cuBLAS may otherwise pick
its split-K/stream workspace differently between calls). A failure reports the max abs difference, so a kernel-choice
difference (~1e-6) reads apart from a logic error (large).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdvg.fixtures.tiny import ensure_tiny  # noqa: E402
from sdvg.loaders.bundle import load_models  # noqa: E402
from sdvg.outputs.files import write_json  # noqa: E402
from sdvg.sampling.regimes import CacheConfig, CacheRegime  # noqa: E402
from sdvg.sampling.router import RouterConfig  # noqa: E402
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler  # noqa: E402

PROMPT = "a red fox running through snow"


def run(models, router, regime="recompute", blocks=4, **kw):
    cfg = SamplerConfig(num_blocks=blocks, width=64, height=64, cache=CacheConfig(regime=CacheRegime(regime)), **kw)
    return SpeculativeSampler(models, router, cfg).run(PROMPT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cuda_smoke.json")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the --cpu-smoke run)")
    args = ap.parse_args()
    dev = args.device
    results: dict = {"torch": torch.__version__, "device": dev, "cuda": torch.cuda.is_available(), "checks": {},
                     "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_json(out, results)  # atomic: a run killed mid-write leaves the last whole summary

    if dev.startswith("cuda") and not torch.cuda.is_available():
        results["error"] = "no CUDA device"
        save()
        sys.stderr.write("no CUDA device\n")
        return 2
    results["gpu"] = torch.cuda.get_device_name(0) if dev.startswith("cuda") else None
    save()
    start = time.perf_counter()
    root, created = ensure_tiny()
    results["tiny_preset_s"] = time.perf_counter() - start
    sys.stderr.write(f"tiny preset {'built' if created else 'cached'} in {results['tiny_preset_s']:.1f} s\n")
    ok = True

    def check(name, fn):
        nonlocal ok
        start = time.perf_counter()
        try:
            value = fn()
            passed = bool(value.get("passed", True)) if isinstance(value, dict) else bool(value)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going
            value, passed = {"error": repr(exc), "traceback": traceback.format_exc()}, False
        results["checks"][name] = {"passed": passed, "seconds": time.perf_counter() - start,
                                   **(value if isinstance(value, dict) else {})}
        ok = ok and passed
        save()
        sys.stderr.write(f"{'PASS' if passed else 'FAIL'} {name}\n")

    fp32 = load_models(root, dit_device=dev, aux_device=dev, dtype="fp32")

    def reject_all_equals_target_only(regime):
        def fn():
            spec = run(fp32, RouterConfig(mode="reward", tau=math.inf), regime)
            ref = run(fp32, RouterConfig(mode="target-only"), regime)
            return {"passed": torch.equal(spec.latents, ref.latents) and torch.equal(spec.frames, ref.frames),
                    "max_abs_latent_diff": float((spec.latents.float() - ref.latents.float()).abs().max())}
        return fn

    for regime in ("recompute", "global", "noisy"):
        check(f"reject_all_bit_exact_target_only[{regime}]", reject_all_equals_target_only(regime))

    def pipelined_equals_plain():
        router = RouterConfig(mode="random", random_rate=0.5, seed=3)
        a = run(fp32, router, blocks=6)
        b = run(fp32, router, blocks=6, pipelined=True)
        return {"passed": torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames),
                "decisions": [r.decision for r in a.blocks]}

    check("pipelined_equals_plain", pipelined_equals_plain)
    bf16 = load_models(root, dit_device=dev, aux_device=dev, dtype="bf16")

    def bf16_finite():
        res = run(bf16, RouterConfig(mode="reward", tau=0.0), blocks=3)
        dits = {}
        for name in ("target", "drafter"):
            m = getattr(bf16, name)
            dits[name] = str(m.compute_dtype)
        return {"passed": bool(torch.isfinite(res.latents).all()) and bool(torch.isfinite(res.frames).all())
                and all(v == "torch.bfloat16" for v in dits.values()), "dtypes": dits,
                "decisions": [r.decision for r in res.blocks]}

    check("bf16_generation_finite", bf16_finite)
    results["passed"] = ok
    save()
    sys.stderr.write(f"wrote {args.out}: {'all passed' if ok else 'FAILURES'}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
