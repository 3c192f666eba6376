"""A memory plan for Diagonal Distillation training of the real Self-Forcing 1.3B under FSDP: an *estimate* of the
bytes each GPU holds, from parameter counts and activation shapes, never a measurement.

DMD trains two networks, the student (generator) and the fake score, against a frozen teacher (the real score). With
``P`` the parameters of one DiT (all three share the 1.3B architecture), ``N`` GPUs with FSDP full sharding
(``FULL_SHARD``: parameters, gradients and optimizer states each split ``1/N``), ``B`` videos per GPU, ``dim`` the
hidden width, ``ffn`` the feed-forward width and ``layers`` the number of blocks, the items are:

* ``teacher``: frozen bf16 weights, sharded: ``P * 2 / N``;
* ``student``: fp32 master weights + fp32 grads + AdamW's two fp32 moments, sharded: ``P * 16 / N``;
* ``student_ema``: an fp32 EMA of the student, sharded: ``P * 4 / N``;
* ``fake_score``: as the student, without EMA: ``P * 16 / N``;
* ``gathered_blocks``: FSDP unshards one transformer block at a time plus one prefetched, in bf16:
  ``2 * block_params * 2`` (the largest block; does not shrink with ``N``);
* ``activations``: what the backward of *one* DiT forward keeps (the student's or the fake score's, never both at
  once; the teacher runs without grad). ``L = frames * (h / ph) * (w / pw)`` tokens, doubled (``2L``) with
  ``context_forward`` (the ``[clean context, noisy]`` layout of ``forward_with_context``). With gradient
  checkpointing each layer keeps its input ``[B, S, dim]`` in bf16, plus one layer's inside recomputed in the
  backward, ``~ B * S * (8 * dim + ffn) * 2`` bytes; without it every layer keeps ``~ B * S * (8 * dim + ffn) * 2``
  bytes. Attention is per-block SDPA with no mask (``models/block_attention.py``: no ``S x S`` score matrix or mask);
* ``kv_cache``: the student's no-grad rollout self-attention cache, bf16 K and V for every layer over the whole
  clip: ``layers * 2 * B * L * dim * 2``;
* ``text_embeddings``: the UMT5 embeddings of the prompt and the negative prompt, bf16:
  ``B * text_tokens * 4096 * 2 * 2``.

Not counted: the CUDA context and NCCL buffers, allocator fragmentation, FSDP's flat-parameter padding, the VAE and
the text encoder (assumed offline / cached), the cross-attention K/V, the timestep embeddings and the output head's
activations. Leave headroom (typically 10-20 %) above the total.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..errors import ConfigError
from ..loaders.wan_keys import make_config
from ..models.dit import CausalWanTransformer

# The real Self-Forcing 1.3B (Wan 2.1 T2V 1.3B): 12 heads x 128, ffn 8960, 30 layers, UMT5 text, patch (1, 2, 2).
WAN_1P3B: dict[str, Any] = make_config(12, 128, 16, 16, 4096, 256, 8960, 30, (1, 2, 2))

UMT5_DIM = 4096  # width of the cached text embeddings (the Wan 2.1 UMT5-XXL encoder)
BF16 = 2
FP32 = 4
GIB = 1024**3

# (key, row label) of the byte items of a plan, in table order; "total" is their sum
ITEMS: tuple[tuple[str, str], ...] = (
    ("teacher", "teacher (bf16, frozen)"),
    ("student", "student (fp32 w + grad + AdamW)"),
    ("student_ema", "student EMA (fp32)"),
    ("fake_score", "fake score (fp32 w + grad + AdamW)"),
    ("gathered_blocks", "gathered blocks (bf16, 1 + prefetch)"),
    ("activations", "activations (one DiT backward)"),
    ("kv_cache", "rollout KV cache (bf16)"),
    ("text_embeddings", "text embeddings (cond + neg)"),
)


def _frozen(config: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


@functools.lru_cache(maxsize=8)
def _count(frozen: tuple) -> tuple[int, int]:
    with torch.device("meta"):
        model = CausalWanTransformer(**dict(frozen))
    total = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks)
    return int(total), int(block)


def dit_param_count(config: dict) -> tuple[int, int]:
    """(total parameters, parameters of the largest transformer block) of a ``CausalWanTransformer`` built from
    ``config`` on the meta device (no memory)."""
    return _count(_frozen(config))


def memory_plan(
    *, config: dict, gpus: int, batch_per_gpu: int = 1, num_frames: int = 21, latent_hw=(60, 104),
    text_tokens: int = 512, gradient_checkpointing: bool = True, context_forward: bool = True,
) -> dict:
    """Bytes per GPU, by item (the keys of :data:`ITEMS`), and the total (an estimate; see the module docstring).

    Metadata keys: ``gpus``, ``batch_per_gpu``, ``params``, ``block_params``, ``tokens`` (``L``, one clip) and
    ``sequence`` (the tokens of one training forward: ``2L`` with ``context_forward``)."""
    if gpus < 1 or batch_per_gpu < 1 or num_frames < 1 or text_tokens < 0:
        raise ConfigError("gpus, batch_per_gpu and num_frames must be >= 1 and text_tokens >= 0.")
    pt, ph, pw = (int(p) for p in config["patch_size"])
    h, w = (int(s) for s in latent_hw)
    if num_frames % pt or h % ph or w % pw:
        raise ConfigError(f"Latent {num_frames}x{h}x{w} is not divisible by the patch size {pt}x{ph}x{pw}.")
    params, block_params = dit_param_count(config)
    dim = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    ffn = int(config["ffn_dim"])
    layers = int(config["num_layers"])
    b, n = int(batch_per_gpu), int(gpus)
    tokens = (num_frames // pt) * (h // ph) * (w // pw)
    seq = 2 * tokens if context_forward else tokens
    layer_inside = b * seq * (8 * dim + ffn) * BF16
    if gradient_checkpointing:
        activations = layers * b * seq * dim * BF16 + layer_inside
    else:
        activations = layers * layer_inside
    items = {
        "teacher": math.ceil(params * BF16 / n),
        "student": math.ceil(params * (FP32 * 4) / n),
        "student_ema": math.ceil(params * FP32 / n),
        "fake_score": math.ceil(params * (FP32 * 4) / n),
        "gathered_blocks": 2 * block_params * BF16,
        "activations": activations,
        "kv_cache": layers * 2 * b * tokens * dim * BF16,
        "text_embeddings": b * text_tokens * UMT5_DIM * BF16 * 2,
    }
    return {
        **items,
        "total": sum(items.values()),
        "gpus": n,
        "batch_per_gpu": b,
        "params": params,
        "block_params": block_params,
        "tokens": tokens,
        "sequence": seq,
    }


def format_plan(plans: list[dict]) -> str:
    """A plain-text table: one column per plan (GPU count), rows = items in GiB, and a total row."""
    if not plans:
        raise ConfigError("format_plan needs at least one plan.")
    first = plans[0]
    head = [
        "Memory plan: an estimate from parameter counts and activation shapes, not a measurement.",
        f"GiB per GPU, FSDP full sharding, batch {first['batch_per_gpu']} per GPU, {first['params'] / 1e9:.3f}B "
        f"parameters per DiT, {first['sequence']} tokens per training forward.",
    ]
    rows = [(label, [p[key] for p in plans]) for key, label in ITEMS] + [("total", [p["total"] for p in plans])]
    cols = [f"{p['gpus']} GPU" + ("s" if p["gpus"] != 1 else "") for p in plans]
    lw = max(len(label) for label, _ in rows)
    cw = max(8, *(len(c) for c in cols))
    header = f"{'item':<{lw}}  " + "  ".join(f"{c:>{cw}}" for c in cols)
    lines = [*head, header, "-" * len(header)]
    for label, values in rows:
        if label == "total":
            lines.append("-" * len(header))
        lines.append(f"{label:<{lw}}  " + "  ".join(f"{v / GIB:>{cw}.2f}" for v in values))
    return "\n".join(lines)
