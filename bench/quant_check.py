"""GGUF and scaled-fp8 DiTs on one device (CPU here; CUDA when a GPU is lent): correctness and the dequant cost.

    .venv/bin/python bench/quant_check.py --device cpu --out out/quant_check.json
    .venv/bin/python bench/quant_check.py --device cuda --dtype bf16 --out out/quant_check_cuda.json

Checks, on tiny files written with gguf's writer (sdvg/fixtures/quant_files.py): every torch kernel on the device
equals gguf's numpy ``dequantize`` on random bytes; the tiny Q4_K_M-like target's forward equals the forward with the
dequantized weights (bit for bit), also with 1 of 4 blocks resident (the side-stream prefetch on CUDA); a scaled-fp8
target equals a hand dequantization. Then times ``forward_block`` (median and interquartile range of --repeats
runs, after a warm-up) for the GGUF model, its dequantized twin and the fp8-scaled model: the price of dequantizing
per layer at tiny size (not a real-size figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _kernels(device: torch.device) -> dict[str, bool]:
    import gguf

    from sdvg.models.quant import GGML_TYPES, dequantize_blocks

    out = {}
    for qt, kind in GGML_TYPES.items():
        if kind.kernel is None:
            continue
        raw = np.random.default_rng(qt).integers(0, 256, (256, kind.block_bytes), dtype=np.uint8)
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qt)).reshape(-1)
        got = dequantize_blocks(torch.from_numpy(raw).to(device), qt, (ref.size,)).cpu().numpy()
        out[kind.name] = bool(np.array_equal(got, ref, equal_nan=True))
    return out


def _calls(model, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 3, 8, 8, generator=gen).to(device)
    cross = model.prepare_cross_attention(torch.randn(1, 7, model.config.text_dim, generator=gen).to(device))
    kv = model.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
    t = torch.full((1, 3), 700.0, device=device)
    return [model.forward_block(x, t, kv, cross), model.forward_block(x, t, kv, cross, frame_offset=3)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_calls(a, a.execution_device), _calls(b, b.execution_device),
                                                 strict=True))


def _time(model, repeats: int) -> dict[str, float]:
    dev = model.execution_device
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 8, 8, generator=gen).to(dev)
    cross = model.prepare_cross_attention(torch.randn(1, 7, model.config.text_dim, generator=gen).to(dev))
    t = torch.full((1, 3), 500.0, device=dev)
    runs = []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        model.forward_block(x, t, None, cross)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            runs.append(time.perf_counter() - start)
    q = statistics.quantiles(runs, n=4)
    return {"median_ms": 1e3 * statistics.median(runs), "iqr_ms": [1e3 * q[0], 1e3 * q[2]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="out/quant_check.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    from sdvg.fixtures.quant_files import gguf_dequantized_state, write_fp8_scaled_dit, write_gguf_dit
    from sdvg.fixtures.tiny import TINY_TARGET_CONFIG, random_original_state_dict
    from sdvg.loaders.dit_build import build_dit_from_state_dict
    from sdvg.loaders.wan import load_dit
    from sdvg.loaders.wan_keys import original_to_diffusers

    dev, dtype = torch.device(args.device), torch.float32 if args.dtype == "fp32" else torch.bfloat16
    heads = TINY_TARGET_CONFIG["num_attention_heads"]
    tmp = Path(tempfile.mkdtemp(prefix="sdvg-quant-"))
    sd = random_original_state_dict(TINY_TARGET_CONFIG, seed=7)
    write_gguf_dit(tmp / "t.gguf", sd, qtype="Q4_K", types={"blocks.1.ffn.2.weight": "Q6_K"}, num_heads=heads)
    write_fp8_scaled_dit(tmp / "t_fp8.safetensors", sd, num_heads=heads)
    gguf_model = load_dit(tmp / "t.gguf", dtype=args.dtype, device=dev)
    ref = build_dit_from_state_dict(original_to_diffusers(gguf_dequantized_state(tmp / "t.gguf")), TINY_TARGET_CONFIG,
                                    dtype=dtype, device=dev)
    fp8 = load_dit(tmp / "t_fp8.safetensors", dtype=args.dtype, device=dev)
    result = {
        "device": str(dev), "dtype": args.dtype, "kernels_equal_numpy": _kernels(dev),
        "gguf_forward_equals_dequantized": _same(gguf_model, ref),
        "gguf_offloaded_equals_resident": _same(load_dit(tmp / "t.gguf", dtype=args.dtype, device=dev,
                                                         offload_blocks=1), gguf_model),
        "fp8_scaled_offloaded_equals_resident": _same(load_dit(tmp / "t_fp8.safetensors", dtype=args.dtype,
                                                               device=dev, offload_blocks=1), fp8),
        "weight_bytes": {name: sum(p.numel() * p.element_size() for p in m.parameters())
                         for name, m in (("gguf", gguf_model), ("dequantized", ref), ("fp8_scaled", fp8))},
        "forward_block": {name: _time(m, args.repeats) for name, m in (("gguf", gguf_model), ("dequantized", ref),
                                                                      ("fp8_scaled", fp8))},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")  # CLI output
    ok = all(result["kernels_equal_numpy"].values()) and result["gguf_forward_equals_dequantized"] \
        and result["gguf_offloaded_equals_resident"] and result["fp8_scaled_offloaded_equals_resident"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
