"""GPU check of block offload and load-time LoRA merging (run by bench/gpu_check.sh; CPU-tested only until then).

Checks, each recorded in the JSON written to --out:
1. tiny target (bf16) with 1 resident block and the side-stream prefetch: bit-identical to the resident model;
2. a tiny LoRA merged on the GPU matches the same merge on the CPU (fp32 weights), and a LoRA + fp8 + offload model
   runs with bf16 KV caches;
3. with --real: a random 14B (fp8 storage) at 832x480, one 3-frame block against 3 cached frames, all blocks resident
   vs K resident (default 9, the 24 GiB plan): bit-identical output, seconds per forward and peak allocated memory.

``--device cpu`` runs the same code on the CPU (plain copies instead of the side stream), as a dry check; with
``--real-shape tiny`` check 3 runs the tiny target (8x8 latents) instead of the 14B, as ``gpu_check.sh --cpu-smoke``
does. The JSON is rewritten after every check, so a killed run keeps the ones done.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdvg.fixtures import loras as fl  # noqa: E402
from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, write_tiny_dits  # noqa: E402
from sdvg.loaders.lora import LoraSpec  # noqa: E402
from sdvg.loaders.wan import load_dit, to_fp8_storage  # noqa: E402
from sdvg.models.offload import offload_model  # noqa: E402
from sdvg.outputs.files import write_json  # noqa: E402

GIB = 2**30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward(model, device: torch.device, latent_hw: tuple[int, int], text_len: int = 512, seed: int = 0):
    """Cross-attention prep, a first block writing the cache, then a block attending to it: → (output, seconds of
    the second block)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, *latent_hw, generator=gen).to(device)
    emb = torch.randn(1, text_len, model.config.text_dim, generator=gen).to(device, torch.bfloat16)
    t = torch.full((1, 3), 700.0, device=device)
    cross = model.prepare_cross_attention(emb)
    kv = model.new_kv_cache(batch=1, latent_hw=latent_hw, capacity_frames=6)
    assert kv.layer(0)[0].dtype == torch.bfloat16, kv.layer(0)[0].dtype
    model.forward_block(x, t, kv, cross)
    _sync(device)
    start = time.perf_counter()
    out = model.forward_block(x, t, kv, cross, frame_offset=3)
    _sync(device)
    return out.float().cpu(), time.perf_counter() - start


def tiny_checks(device: torch.device, folder: Path) -> dict:
    dits = write_tiny_dits(folder)
    plain = load_dit(dits["target"], dtype="bf16", device=device)
    off = load_dit(dits["target"], dtype="bf16", device=device, offload_blocks=1)
    a, _ = forward(plain, device, (8, 8), text_len=16)
    b, _ = forward(off, device, (8, 8), text_len=16)
    res = {"offload_bit_identical": bool(torch.equal(a, b)), "resident": off.block_offloader.resident}
    lora = fl.write_lora(folder / "lora.safetensors", fl.lora_factors(TINY_TARGET_CONFIG, rank=4, seed=2), "kohya")
    on_gpu = load_dit(dits["target"], dtype="fp32", device=device, loras=[LoraSpec(lora, 0.7)])
    on_cpu = load_dit(dits["target"], dtype="fp32", device="cpu", loras=[LoraSpec(lora, 0.7)])
    gpu_sd, cpu_sd = on_gpu.state_dict(), on_cpu.state_dict()
    res["lora_max_abs_diff_vs_cpu"] = max(float((gpu_sd[k].cpu() - v).abs().max()) for k, v in cpu_sd.items())
    res["lora_matches_cpu"] = res["lora_max_abs_diff_vs_cpu"] <= 1e-6
    both = load_dit(dits["target"], dtype="fp8_e4m3fn", device=device, offload_blocks=2, loras=[LoraSpec(lora)])
    out, _ = forward(both, device, (8, 8), text_len=16)
    res["fp8_lora_offload_finite"] = bool(torch.isfinite(out).all())
    res["ok"] = res["offload_bit_identical"] and res["lora_matches_cpu"] and res["fp8_lora_offload_finite"]
    return res


def real_check(device: torch.device, resident: int, shape: str = "real") -> dict:
    """The random 14B (fp8 storage) at 480x832 (``shape="tiny"``: the tiny target at 8x8 latents), resident vs
    ``resident`` blocks."""
    from sdvg.fixtures.random_models import random_dit
    from sdvg.loaders.wan_keys import config_for_size

    config, latent_hw = (config_for_size("14B"), (60, 104)) if shape == "real" else (TINY_TARGET_CONFIG, (8, 8))
    model = random_dit(config, device, torch.bfloat16, seed=2)
    to_fp8_storage(model)
    forward(model, device, latent_hw)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    a, plain_s = forward(model, device, latent_hw)
    peak_plain = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    offload_model(model, device, resident)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    forward(model, device, latent_hw)  # warm-up of the streaming path
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    b, off_s = forward(model, device, latent_hw)
    peak_off = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"shape": shape, "blocks": len(model.blocks), "resident": resident, "bit_identical": bool(torch.equal(a, b)), "plain_s": plain_s, "offload_s": off_s,
            "peak_plain_gib": peak_plain / GIB if peak_plain else None,
            "peak_offload_gib": peak_off / GIB if peak_off else None, "ok": bool(torch.equal(a, b))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="offload_lora.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--real", action="store_true", help="also the random 14B at 832x480 (about 30 GB of GPU memory)")
    ap.add_argument("--resident", type=int, default=9)
    ap.add_argument("--real-shape", choices=["real", "tiny"], default="real", help="tiny: check 3 on the tiny target")
    args = ap.parse_args()
    device = torch.device(args.device)
    report: dict = {"device": str(device), "torch": torch.__version__}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("tiny", lambda: tiny_checks(device, Path(tmp))),
                         ("real_14b", (lambda: real_check(device, args.resident, args.real_shape)) if args.real else None)):
            if fn is None:
                continue
            try:
                report[name] = fn()
            except Exception as exc:  # noqa: BLE001 - record the failure and go on with the other checks
                report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            ok = ok and report[name]["ok"]
            report["passed"] = ok
            write_json(args.out, report)
            sys.stdout.write(f"{name}: {json.dumps(report[name], default=str)}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
