"""Mask-free block-causal attention (``sdvg/models/block_attention.py``): per-block SDPA calls equal the dense-mask
path they replace (the masks are the reference), also through the DiT's training forwards and their gradients, and
no ``[L, L]`` tensor is built.

Tolerance: fp32 on the CPU. The per-block calls and the masked call compute each query row's softmax over the same
keys, but SDPA's kernels (flash-CPU without a mask, the math path with one) reduce in different orders, so the two
agree to float rounding: ``atol = rtol = 1e-6`` (measured max abs diff ~1e-7 at these shapes), not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sdvg.models.block_attention import (
    block_causal_attention,
    block_causal_mask,
    context_attention,
    context_mask,
    sdpa,
)

TOL = {"atol": 1e-6, "rtol": 1e-6}


def _qkv(gen, b, n, h=2, d=16):
    return [torch.randn(b, n, h, d, generator=gen) for _ in range(3)]


@pytest.mark.parametrize(("frames", "fpb"), [(9, 3), (7, 3), (6, 6), (4, 1)])
def test_block_causal_attention_equals_the_masked_call(frames, fpb):
    gen = torch.Generator().manual_seed(frames * 10 + fpb)
    tpf = 5
    q, k, v = _qkv(gen, 2, frames * tpf)
    ref = sdpa(q, k, v, block_causal_mask(frames, tpf, fpb))
    out = block_causal_attention(q, k, v, fpb * tpf)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, **TOL), float((out - ref).abs().max())


@pytest.mark.parametrize(("frames", "fpb"), [(9, 3), (7, 3), (3, 3)])
def test_context_attention_equals_the_masked_call(frames, fpb):
    gen = torch.Generator().manual_seed(frames + 100 * fpb)
    tpf = 4
    q, k, v = _qkv(gen, 2, 2 * frames * tpf)
    ref = sdpa(q, k, v, context_mask(frames, tpf, fpb))
    out = context_attention(q, k, v, fpb * tpf)
    assert torch.allclose(out, ref, **TOL), float((out - ref).abs().max())


def test_gradients_equal_the_masked_call():
    gen = torch.Generator().manual_seed(5)
    grads = []
    for fn in (lambda q, k, v: sdpa(q, k, v, block_causal_mask(6, 4, 3)),
               lambda q, k, v: block_causal_attention(q, k, v, 12)):
        qkv = [t.clone().requires_grad_(True) for t in _qkv(torch.Generator().manual_seed(5), 1, 24)]
        w = torch.randn(1, 24, 2, 16, generator=gen.manual_seed(6))
        (fn(*qkv) * w).sum().backward()
        grads.append([t.grad for t in qkv])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns (a dense [L, L] mask or score matrix would show here)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module")
def dit():
    from sdvg.toy.dit_train import DiTSpec, build_dit

    return build_dit(DiTSpec(heads=2, head_dim=16, ffn=64, layers=2, text_dim=64), seed=0).eval()


def _masked(model, mask):
    return lambda i, q, k, v: sdpa(q, k, v, mask)


def test_forward_train_equals_the_dense_mask_path_and_builds_no_mask(dit):
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 16, 9, 8, 8, generator=gen), torch.rand(1, 9, generator=gen) * 1000
    cross = dit.cross_attention(torch.randn(1, 12, 64, generator=gen))
    tpf = dit.tokens_per_frame(8, 8)
    with torch.no_grad():
        ref = dit._run(x, t, cross, 0, _masked(dit, block_causal_mask(9, tpf, 3)))
        with _LargestTensor() as seen:
            out = dit.forward_train(x, t, cross)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), float((out - ref).abs().max())
    tokens = 9 * tpf
    assert seen.largest < tokens * tokens  # no [L, L] tensor (mask or scores) anywhere in the forward


def test_forward_with_context_equals_the_dense_mask_path(dit):
    gen = torch.Generator().manual_seed(2)
    ctx, x = torch.randn(1, 16, 6, 8, 8, generator=gen), torch.randn(1, 16, 6, 8, 8, generator=gen)
    t = torch.rand(1, 6, generator=gen) * 1000
    cross = dit.cross_attention(torch.randn(1, 12, 64, generator=gen))
    tpf = dit.tokens_per_frame(8, 8)
    cos, sin = dit._rope(6, 4, 4, 0, torch.device("cpu"))
    with torch.no_grad():
        ref = dit._run(torch.cat([ctx, x], 2), torch.cat([torch.zeros(1, 6), t], 1), cross, 0,
                       _masked(dit, context_mask(6, tpf, 3)), rope=(torch.cat([cos, cos]), torch.cat([sin, sin])))
        out = dit.forward_with_context(ctx, torch.zeros(1, 6), x, t, cross)
    assert torch.allclose(out, ref[:, :, 6:], atol=1e-5, rtol=1e-5), float((out - ref[:, :, 6:]).abs().max())


def test_training_gradients_equal_the_dense_mask_path(dit):
    model = dit.train().requires_grad_(True)
    try:
        gen = torch.Generator().manual_seed(3)
        x, t, emb = torch.randn(1, 16, 6, 8, 8, generator=gen), torch.rand(1, 6, generator=gen) * 1000, torch.randn(
            1, 8, 64, generator=gen)
        mask = block_causal_mask(6, model.tokens_per_frame(8, 8), 3)
        grads = []
        for run in (lambda c: model._run(x, t, c, 0, _masked(model, mask)), lambda c: model.forward_train(x, t, c)):
            model.zero_grad()
            run(model.cross_attention(emb)).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), float((a - b).abs().max())
    finally:
        model.eval().requires_grad_(False)


def test_forward_train_block_equals_the_cached_block_forward_exactly(dit):
    """With per-block calls a training block attends to exactly the keys the cached sampler's block does."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 6, 8, 8, generator=gen)
    t = torch.tensor([[0.0, 0.0, 0.0, 700.0, 700.0, 700.0]])
    emb = torch.randn(1, 12, 64, generator=gen)
    with torch.no_grad():
        full = dit.forward_train(x, t, dit.cross_attention(emb))
    cross = dit.prepare_cross_attention(emb)
    kv = dit.new_kv_cache(batch=1, latent_hw=(8, 8), capacity_frames=6)
    first = dit.forward_block(x[:, :, :3], t[:, :3], kv, cross, frame_offset=0)
    second = dit.forward_block(x[:, :, 3:], t[:, 3:], kv, cross, frame_offset=3)
    assert torch.allclose(full, torch.cat([first, second], 2), atol=1e-6, rtol=1e-6)
