"""The real-size profile: random weights at the released shapes on a GPU, and the memory plan (also on ``meta``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .costs import kv_bytes_for

REAL_WIDTH, REAL_HEIGHT = 832, 480
REAL_SIZE_NOTES = (
    "Random weights at the released shapes: drafter Wan 2.1 1.3B (30 layers, dim 1536), target 14B (40 layers, "
    "dim 5120), bf16; Wan 2.1 VAE base_dim 96 (bf16, as load_models does on CUDA); ImageReward v1.0 shapes (ViT-L/16 "
    "+ 12-layer BERT, fp32 as load_models loads it). Prompt embeddings are random [1, 512, 4096] (no UMT5 run: it "
    "runs once per prompt, outside the timed loop). The tokenizer is the tiny vocabulary (prompt length is padded to "
    "35 tokens either way). Decoded frames are NaN-sanitized before scoring (random VAE weights)."
)


def _param_bytes(module) -> tuple[int, int]:
    n = sum(p.numel() for p in module.parameters())
    b = sum(p.numel() * p.element_size() for p in module.parameters())
    return n, b


def memory_plan(models, s, regimes: Sequence[str] = ("recompute", "noisy", "global")) -> dict:
    """Parameters, KV-cache bytes per regime and the streaming-VAE cache bytes at the bench size (works on meta)."""
    latent_hw = (s.height // 8, s.width // 8)
    plan: dict[str, Any] = {"size": f"{s.width}x{s.height}", "blocks": s.blocks, "models": {}, "kv_cache_bytes": {}}
    for name in ("target", "drafter"):
        model = getattr(models, name)
        n, b = _param_bytes(model)
        plan["models"][name] = {"params": n, "bytes": b, "layers": len(model.blocks),
                                "dim": model.num_heads * model.head_dim}
        plan["kv_cache_bytes"][name] = {
            reg: kv_bytes_for(model, reg, s.blocks * 3, latent_hw, s.window, s.sinks) for reg in regimes
        }
    for name, module in (("vae", models.vae.model), ("reward", models.reward)):
        n, b = _param_bytes(module)
        plan["models"][name] = {"params": n, "bytes": b}
    plan["vae_cache_bytes"] = plan["vae_snapshot_bytes"] = _steady_vae_cache_bytes(models.vae, latent_hw)
    weights = sum(m["bytes"] for m in plan["models"].values())
    plan["total_weights_bytes"] = weights
    plan["total_recompute_bytes"] = (weights + sum(v["recompute"] for v in plan["kv_cache_bytes"].values())
                                     + 2 * plan["vae_cache_bytes"])
    plan["note"] = ("weights + KV caches (recompute regime) + live VAE cache + one snapshot's worth of replaced entries; "
                    "activations and allocator slack are not included")
    return plan


def _steady_vae_cache_bytes(vae, latent_hw: tuple[int, int]) -> int:
    vae.reset()
    with torch.no_grad():
        for _ in range(2):  # the cache reaches its steady size after the first block
            vae.decode_block(torch.zeros((1, 16, 3, *latent_hw), device=vae.device, dtype=vae.dtype))
    nbytes = int(vae.cache_nbytes)
    vae.reset()
    return nbytes


def format_plan(plan: dict) -> str:
    gib = 2**30
    lines = [f"memory plan at {plan['size']}, {plan['blocks']} blocks (random weights, real shapes):"]
    for name, m in plan["models"].items():
        extra = f", {m['layers']} layers, dim {m['dim']}" if "layers" in m else ""
        lines.append(f"  {name:8s} {m['params'] / 1e9:7.3f} B params  {m['bytes'] / gib:7.2f} GiB{extra}")
    for name, kv in plan["kv_cache_bytes"].items():
        lines.append(f"  KV {name:8s} " + "  ".join(f"{reg} {b / gib:.2f} GiB" for reg, b in kv.items()))
    lines.append(f"  VAE decoder cache {plan['vae_cache_bytes'] / gib:.2f} GiB (a snapshot references it; a restore "
                 "keeps up to one more cache's worth alive)")
    lines.append(f"  total (weights + recompute KV + 2× VAE cache): {plan['total_recompute_bytes'] / gib:.1f} GiB; "
                 + plan["note"])
    return "\n".join(lines)
