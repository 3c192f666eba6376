"""What it takes to run the real 14B + 1.3B pair on one consumer card (24 GiB by default): fp8 weights, K resident
target blocks, the cache regime, and where the VAE, ImageReward and text encoder go.

Every figure is computed from the real-size models on the meta device (parameter bytes after the same fp8
conversion the loader does, KV-cache bytes from the cache layout, the VAE decoder cache measured on meta) except two
stated allowances that only a GPU can measure: the CUDA context and the activations' peak. ``bench/gpu_check.sh``
runs the offload path on a GPU and records the real peak when one is lent.
"""

from __future__ import annotations

import math
from typing import Any

from ..sampling.footprint import cross_attn_bytes

GIB = 2**30
CARD_BYTES = 24 * GIB
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # allowance: CUDA context, cuBLAS/cuDNN workspaces, allocator slack
ACTIVATION_BYTES = 3 * GIB  # allowance: peak live activations (a 3-frame DiT block forward, the VAE's last stage)
# UMT5-XXL encoder (d_model 4096, d_ff 10240, 24 layers, 64 heads × 64, vocab 256384): embedding + 24 × (4 attention
# projections + 3 gated-FFN matrices), in parameters
UMT5_XXL_PARAMS = 256384 * 4096 + 24 * (4 * 4096 * 4096 + 3 * 4096 * 10240)


def _fp8_model(model):
    """The meta twin of ``model`` with the loader's fp8 storage dtypes."""
    from ..loaders.wan import empty_dit, to_fp8_storage
    from ..loaders.wan_keys import CONFIG_KEYS

    twin = empty_dit({k: model.config[k] for k in CONFIG_KEYS})
    to_fp8_storage(twin)
    return twin


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _target_bytes(model, target: str) -> tuple[int, int]:
    """(bytes of one block, bytes outside the blocks) of the target as ``target``: SDVG's fp8 storage, or a GGUF /
    scaled-fp8 file's stored form (``loaders.dit_build.stored_form_bytes``)."""
    if target == "fp8_e4m3fn":
        twin = _fp8_model(model)
        block = _bytes(twin.blocks[0].parameters())
        return block, _bytes(twin.parameters()) - sum(_bytes(b.parameters()) for b in twin.blocks)
    from ..loaders.dit_build import stored_form_bytes
    from ..loaders.wan_keys import CONFIG_KEYS, original_key_shapes

    sizes = stored_form_bytes(original_key_shapes({k: model.config[k] for k in CONFIG_KEYS}), target)
    block = sum(b for k, b in sizes.items() if k.startswith("blocks.0."))
    return block, sum(sizes.values()) - len(model.blocks) * block


def card_plan(models, plan: dict, *, card_bytes: int = CARD_BYTES, drafter_dtype: str = "fp8_e4m3fn",
              target: str = "fp8_e4m3fn") -> dict[str, Any]:
    """The fit of the real-size pair on a card of ``card_bytes`` with the target as ``target`` (fp8 storage, or a
    GGUF type such as Q4_K) with its blocks offloaded and the drafter in ``drafter_dtype`` (fp8_e4m3fn or bf16:
    ``--drafter-dtype``), for each cache regime of ``plan`` (from :func:`real_size.memory_plan`)."""
    drafter = _fp8_model(models.drafter) if drafter_dtype == "fp8_e4m3fn" else models.drafter
    block, target_other = _target_bytes(models.target, target)
    layers = len(models.target.blocks)
    fixed = {
        "CUDA context and workspaces (allowance)": CUDA_CONTEXT_BYTES,
        "activations (allowance)": ACTIVATION_BYTES,
        f"target non-block weights ({'fp8 storage' if target == 'fp8_e4m3fn' else target})": target_other,
        "target 2 streaming slots": 2 * block,
        f"drafter weights ({'fp8 storage' if drafter_dtype == 'fp8_e4m3fn' else drafter_dtype})":
            _bytes(drafter.parameters()),
        "VAE weights": plan["models"]["vae"]["bytes"],
        "VAE decoder cache + one snapshot": 2 * plan["vae_cache_bytes"],
        "ImageReward weights (fp32)": plan["models"]["reward"]["bytes"],
        "cross-attention caches (both DiTs)": cross_attn_bytes(models.target) + cross_attn_bytes(models.drafter),
    }
    regimes = {}
    for regime, kv_target in plan["kv_cache_bytes"]["target"].items():
        kv = kv_target + plan["kv_cache_bytes"]["drafter"][regime]
        room = card_bytes - sum(fixed.values()) - kv
        k = max(-1, min(layers, math.floor(room / block)))
        regimes[regime] = {"kv_bytes": kv, "resident_blocks": k if k >= 0 else None, "fits": k >= 0,
                           "streamed_bytes_per_forward": (layers - k) * block if k >= 0 else None}
    best = next((r for r in ("recompute", "noisy", "global") if regimes.get(r, {}).get("fits")), None)
    k = regimes[best]["resident_blocks"] if best else None
    settings = None
    if best:
        settings = {"dtype": "fp8_e4m3fn", "target": target, "drafter_dtype": drafter_dtype, "target_offload_blocks": k, "cache": best, "device": "cuda",
                    "aux_device": "cuda (VAE, ImageReward)", "text_encoder_device": "cpu (bf16, once per prompt)"}
    return {
        "card_bytes": card_bytes, "size": plan["size"], "target": target, "block_bytes": block, "layers": layers, "fixed": fixed,
        "regimes": regimes, "best": best, "settings": settings,
        "cpu_bytes": {"streamed target blocks (pinned)": (layers - k) * block if best else None,
                      "UMT5-XXL text encoder (bf16)": 2 * UMT5_XXL_PARAMS},
    }


def format_card_plan(cp: dict) -> str:
    card = cp["card_bytes"] / GIB
    kind = cp.get("target", "fp8_e4m3fn")
    lines = [f"fit on a {card:.0f} GiB card at {cp['size']} (14B target as {kind} + 1.3B drafter, target-block "
             f"offload; {cp['layers']} target blocks of {cp['block_bytes'] / GIB:.3f} GiB each):"]
    lines += [f"  {name:42s} {b / GIB:6.2f} GiB" for name, b in cp["fixed"].items()]
    for regime, r in cp["regimes"].items():
        if r["fits"]:
            lines.append(f"  cache {regime:9s}: KV {r['kv_bytes'] / GIB:5.2f} GiB -> {r['resident_blocks']} of "
                         f"{cp['layers']} target blocks resident, {r['streamed_bytes_per_forward'] / GIB:.1f} GiB "
                         "streamed per target forward")
        else:
            lines.append(f"  cache {regime:9s}: KV {r['kv_bytes'] / GIB:5.2f} GiB -> does not fit, even with every "
                         "target block streamed")
    for name, b in cp["cpu_bytes"].items():
        if b is not None:
            lines.append(f"  CPU RAM: {name} {b / GIB:.1f} GiB")
    s = cp["settings"]
    if s:
        if s["target"] != "fp8_e4m3fn":
            dtypes = f"--target <a {s['target']} GGUF file> --drafter-dtype {s['drafter_dtype']}"
        elif s["drafter_dtype"] == s["dtype"]:
            dtypes = f"--dtype {s['dtype']}"
        else:
            dtypes = f"--target-dtype {s['dtype']} --drafter-dtype {s['drafter_dtype']}"
        lines.append(f"  settings: {dtypes} --target-offload-blocks {s['target_offload_blocks']} --cache "
                     f"{s['cache']} --device cuda --text-encoder-device cpu (VAE and ImageReward on the GPU)")
    else:
        lines.append("  no setting fits this card")
    lines.append("  allowances (not measured here): CUDA context and activations; bench/gpu_check.sh measures the peak")
    return "\n".join(lines)


def check_positive(card_gib: float) -> int:
    from ..errors import ConfigError

    if not math.isfinite(card_gib) or card_gib <= 0:
        raise ConfigError(f"--card-gib must be a positive number of GiB, got {card_gib!r}.")
    return int(card_gib * GIB)


__all__ = ["card_plan", "format_card_plan", "CARD_BYTES", "check_positive"]
