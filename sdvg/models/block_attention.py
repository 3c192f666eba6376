"""Block-causal self-attention without a dense mask: one SDPA call per query block over the keys it may see.

A clip of ``L`` tokens is cut into blocks of ``block_tokens`` (frames per block × tokens per frame; the last block may
be shorter). Block ``j``'s queries see the keys of blocks ``0..j``: a prefix of the sequence, so each block is one
unmasked ``scaled_dot_product_attention`` call over a slice, and no ``[L, L]`` mask is ever built. At the real
1.3B training shape (21 + 21 frames of 1560 tokens) the dense mask was a 4.3 GB bool tensor that kept SDPA off its
flash kernel; per-block calls keep every call mask-free (flash / cuDNN eligible) and skip the masked-out half of the
work. Numerically each query row is the same softmax over the same keys as with the mask; the kernels reduce in
their own order, so the result equals the masked path to float rounding (tests/test_block_attention.py: bit-exact
where it is, else within 1e-6 relative in fp32).

The masks themselves stay here as the reference definitions (:func:`block_causal_mask`, :func:`context_mask`),
used by the tests and small enough to build at tiny shapes only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on ``[B, L, H, D]`` tensors."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def _bounds(length: int, block_tokens: int) -> list[tuple[int, int]]:
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}.")
    return [(s, min(s + block_tokens, length)) for s in range(0, length, block_tokens)]


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """``[B, L, H, D]`` attention where block ``j`` of ``q`` sees blocks ``0..j`` of ``k``/``v`` (no mask)."""
    outs = [sdpa(q[:, s:e], k[:, :e], v[:, :e]) for s, e in _bounds(q.shape[1], block_tokens)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Attention over ``[context, x]`` (``q/k/v [B, 2L, H, D]``, each half ``L`` tokens) as :func:`context_mask`
    defines it: a context block sees the context blocks up to itself; block ``j`` of ``x`` sees the context blocks
    before it and itself. Per block: one call over ``[ctx keys before j, x keys of j]`` (a copy of the keys that
    block sees, never a mask)."""
    n = q.shape[1] // 2
    if q.shape[1] != 2 * n:
        raise ConfigError("context_attention needs [context, x] halves of equal length.")
    ctx = block_causal_attention(q[:, :n], k[:, :n], v[:, :n], block_tokens)
    outs = [ctx]
    for s, e in _bounds(n, block_tokens):
        ks = torch.cat([k[:, :s], k[:, n + s:n + e]], 1) if s else k[:, n + s:n + e]
        vs = torch.cat([v[:, :s], v[:, n + s:n + e]], 1) if s else v[:, n + s:n + e]
        outs.append(sdpa(q[:, n + s:n + e], ks, vs))
    return torch.cat(outs, 1)


def block_causal_mask(num_frames: int, tokens_per_frame: int, frames_per_block: int, device=None) -> torch.Tensor:
    """Reference boolean ``[L, L]`` mask (tiny shapes only): a token sees every token of its own and earlier blocks."""
    blk = torch.arange(num_frames, device=device).div(frames_per_block, rounding_mode="floor")
    blk = blk.repeat_interleave(tokens_per_frame)
    return blk.unsqueeze(1) >= blk.unsqueeze(0)


def context_mask(num_frames: int, tokens_per_frame: int, frames_per_block: int, device=None) -> torch.Tensor:
    """Reference boolean ``[2L, 2L]`` mask over ``[context, x]`` (tiny shapes only), as :func:`context_attention`
    computes it."""
    blk = torch.arange(num_frames, device=device).div(frames_per_block, rounding_mode="floor")
    blk = blk.repeat_interleave(tokens_per_frame)
    ctx_ctx = blk.unsqueeze(1) >= blk.unsqueeze(0)
    x_ctx = blk.unsqueeze(1) > blk.unsqueeze(0)
    x_x = blk.unsqueeze(1) == blk.unsqueeze(0)
    top = torch.cat([ctx_ctx, torch.zeros_like(ctx_ctx)], 1)
    return torch.cat([top, torch.cat([x_ctx, x_x], 1)], 0)
