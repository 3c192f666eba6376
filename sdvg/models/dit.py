"""Causal block forward for the Wan 2.1 DiT on top of diffusers' ``WanTransformer3DModel``.

Same constructor, config and state-dict names as diffusers; only the forward is ours. Numerics follow the
reference causal models: fp32 RMS norm (cast back before the weight), fp64 sinusoidal timestep embedding,
fp64 RoPE tables (applied in fp32) with a temporal frame offset, per-frame modulation, and K/V kept after RoPE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

from ..blocks import rope_positions
from ..errors import ConfigError
from .block_attention import block_causal_attention, context_attention, sdpa
from .kv_cache import CrossAttnCache, SelfKVCache

logger = logging.getLogger(__name__)

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_ROPE_CACHE_MAX = 16
#: what a drafter and its target must share: the latent space and the text embeddings (the patching is each model's own:
#: its tokens and its KV cache are its own, only latents pass between them)
PAIR_KEYS = ("in_channels", "out_channels", "text_dim")


def check_dit_pair(target: Any, drafter: Any, *, target_name: str = "the target",
                   drafter_name: str = "the drafter") -> None:
    """Drafter and target (their configs) share the latent space and the text encoder."""
    def as_tuple(value: Any) -> tuple:
        return tuple(value) if isinstance(value, list | tuple) else (value,)

    for key in PAIR_KEYS:
        if as_tuple(target[key]) != as_tuple(drafter[key]):
            raise ConfigError(
                f"Drafter and target do not match: {key} is {drafter[key]} for {drafter_name} and {target[key]} for "
                f"{target_name}. Both must be Wan 2.1 T2V DiTs sharing the latent space and the text encoder: pick a "
                "drafter made for this target (e.g. Self-Forcing for Krea)."
            )


def _wide_float(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[cos, sin]`` timestep embedding (diffusers ``Timesteps(flip_sin_to_cos=True, shift=0)``) in float64."""
    wide = _wide_float(t.device)
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, device=t.device, dtype=wide) / half)
    ang = t.to(wide).reshape(-1, 1) * freqs.reshape(1, -1)
    emb = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMS norm in fp32, cast back, then the affine weight (reference ``WanRMSNorm`` order)."""
    eps = norm.eps if getattr(norm, "eps", None) is not None else torch.finfo(torch.float32).eps
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    w = getattr(norm, "weight", None)
    return y * w.to(x.dtype) if w is not None else y


class CausalWanTransformer(WanTransformer3DModel):
    """``WanTransformer3DModel`` with a block-causal, KV-cached forward (``forward_block``)."""

    # ------------------------------------------------------------------ helpers
    @property
    def compute_dtype(self) -> torch.dtype:
        """Activation dtype (the patch embedding is never fp8-cast by layerwise casting)."""
        dt = self.patch_embedding.weight.dtype
        return torch.bfloat16 if dt.itemsize == 1 else dt

    @property
    def execution_device(self) -> torch.device:
        """Where activations live: ``sdvg_execution_device`` if set (group offload), else the patch embedding's."""
        dev = self.__dict__.get("sdvg_execution_device")
        return torch.device(dev) if dev is not None else self.patch_embedding.weight.device

    def _in_dtype(self, linear: torch.nn.Module) -> torch.dtype:
        """Input dtype for a linear layer (its weight dtype; the compute dtype for fp8 storage)."""
        dt = linear.weight.dtype
        return dt if dt.itemsize > 1 else self.compute_dtype

    @property
    def block_offloader(self):
        """The :class:`~sdvg.offload.BlockOffloader` that streams this model's blocks, or None (all resident)."""
        return self.__dict__.get("_sdvg_block_offloader")

    def set_block_offloader(self, offloader) -> None:
        """Run the blocks through ``offloader`` (None: plain iteration over resident blocks)."""
        self.__dict__["_sdvg_block_offloader"] = offloader

    def iter_blocks(self):
        """``(i, block)`` in order, each block's weights on the execution device while the caller uses it."""
        offloader = self.block_offloader
        return enumerate(self.blocks) if offloader is None else iter(offloader)

    @property
    def head_dim(self) -> int:
        return int(self.config.attention_head_dim)

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    def tokens_per_frame(self, h: int, w: int) -> int:
        _, ph, pw = self.config.patch_size
        if h % ph or w % pw:
            raise ConfigError(f"Latent size {h}x{w} is not divisible by the patch size {ph}x{pw}.")
        return (h // ph) * (w // pw)

    def new_kv_cache(
        self, *, batch: int, latent_hw: tuple[int, int], capacity_frames: int, rolling: bool = False,
        sink_frames: int = 0, device=None, dtype: torch.dtype | None = None, rope_on_read: bool = False,
    ) -> SelfKVCache:
        """Allocate a self-attention cache sized for this model."""
        return SelfKVCache(
            num_layers=len(self.blocks), batch=batch, tokens_per_frame=self.tokens_per_frame(*latent_hw),
            capacity_frames=capacity_frames, heads=self.num_heads, head_dim=self.head_dim,
            device=device if device is not None else self.execution_device,
            dtype=dtype or self.compute_dtype, rolling=rolling, sink_frames=sink_frames, rope_on_read=rope_on_read,
        )

    def _rope(self, f: int, h: int, w: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[L, 1, head_dim/2]`` (fp32) for frames offset..offset+f, built from fp64 angles."""
        key = (f, h, w, int(offset), str(device))
        cache = self.__dict__.setdefault("_sdvg_rope_cache", {})
        hit = cache.get(key)
        if hit is not None:
            return hit
        d = self.head_dim
        dh = dw = 2 * (d // 6)
        dt = d - dh - dw
        theta = 10000.0

        wide = _wide_float(device)

        def angles(dim: int, start: int, count: int) -> torch.Tensor:
            exp = torch.arange(0, dim, 2, device=device, dtype=wide)[: dim // 2] / dim
            pos = torch.arange(start, start + count, device=device, dtype=wide)
            return pos.reshape(-1, 1) * (1.0 / torch.pow(theta, exp)).reshape(1, -1)

        at, ah, aw = angles(dt, offset, f), angles(dh, 0, h), angles(dw, 0, w)
        ang = torch.cat(
            [
                at[:, None, None, :].expand(f, h, w, -1),
                ah[None, :, None, :].expand(f, h, w, -1),
                aw[None, None, :, :].expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(f * h * w, 1, d // 2)
        out = (torch.cos(ang).float(), torch.sin(ang).float())
        if len(cache) >= _ROPE_CACHE_MAX:
            cache.pop(next(iter(cache)))
        cache[key] = out
        return out

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate consecutive pairs of ``x [B, L, H, D]`` (complex form of the reference)."""
        xf = x.float().unflatten(-1, (-1, 2))
        x1, x2 = xf[..., 0], xf[..., 1]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)

    _sdpa = staticmethod(sdpa)

    # ------------------------------------------------------------------ conditioning
    @torch.inference_mode()
    def prepare_cross_attention(self, prompt_embeds: torch.Tensor) -> CrossAttnCache:
        """Text embedder once, then per-layer cross-attention K (normed) and V."""
        return self.cross_attention(prompt_embeds)

    def cross_attention(self, prompt_embeds: torch.Tensor) -> CrossAttnCache:
        """:meth:`prepare_cross_attention` with autograd (training); ``prompt_embeds [B, L, text_dim]``."""
        te = self.condition_embedder.text_embedder
        ctx = prompt_embeds.to(self.execution_device, self._in_dtype(te.linear_1))
        ctx = te(ctx).to(self.compute_dtype)
        ks, vs = [], []
        for _, blk in self.iter_blocks():
            attn = blk.attn2
            if attn.add_k_proj is not None:
                raise ConfigError("Image-conditioned (I2V) Wan checkpoints are not supported; use a T2V DiT.")
            if getattr(attn, "fused_projections", False):
                k, v = attn.to_kv(ctx).chunk(2, dim=-1)
            else:
                k, v = attn.to_k(ctx), attn.to_v(ctx)
            k = _rms(attn.norm_k, k)
            ks.append(k.unflatten(2, (attn.heads, -1)))
            vs.append(v.unflatten(2, (attn.heads, -1)))
        return CrossAttnCache(ks, vs)

    def _time(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-frame ``temb [B, F, dim]`` and ``e [B, F, 6, dim]`` (fp32) from ``t [B, F]``."""
        ce = self.condition_embedder
        b, f = t.shape
        emb = sinusoidal_embedding(t.reshape(-1), ce.timesteps_proj.num_channels)
        temb = ce.time_embedder(emb.to(self._in_dtype(ce.time_embedder.linear_1)))
        proj = ce.time_proj(ce.act_fn(temb.to(self._in_dtype(ce.time_proj))))
        return temb.float().reshape(b, f, -1), proj.float().reshape(b, f, 6, -1)

    # ------------------------------------------------------------------ core
    def _self_qkv(self, attn, x: torch.Tensor, cos, sin, rope_k: bool = True):
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        q = _rms(attn.norm_q, q).unflatten(2, (attn.heads, -1))
        k = _rms(attn.norm_k, k).unflatten(2, (attn.heads, -1))
        v = v.unflatten(2, (attn.heads, -1))
        return self._apply_rope(q, cos, sin), (self._apply_rope(k, cos, sin) if rope_k else k), v

    def _layer(self, i: int, x, e, rope, cross: CrossAttnCache, attend: AttendFn, f: int,
               rope_k: bool = True) -> torch.Tensor:
        blk = self.blocks[i]
        b, n, dim = x.shape
        mod = (blk.scale_shift_table.float().unsqueeze(1) + e).unsqueeze(3)  # [B, F, 6, 1, dim]
        shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(2)
        xf = x.view(b, f, n // f, dim)
        h = (blk.norm1(xf.float()) * (1 + scale) + shift).to(x.dtype).view(b, n, dim)
        q, k, v = self._self_qkv(blk.attn1, h, *rope, rope_k=rope_k)
        a = attend(i, q, k, v).flatten(2).to(x.dtype)
        a = blk.attn1.to_out[0](a)
        x = (xf.float() + a.view(b, f, n // f, dim).float() * gate).to(x.dtype).view(b, n, dim)
        # cross-attention (cached K/V)
        attn2 = blk.attn2
        h = blk.norm2(x.float()).to(x.dtype)
        q2 = _rms(attn2.norm_q, attn2.to_q(h)).unflatten(2, (attn2.heads, -1))
        c = self._sdpa(q2, cross.k[i], cross.v[i]).flatten(2).to(x.dtype)
        x = x + attn2.to_out[0](c)
        # feed-forward
        xf = x.view(b, f, n // f, dim)
        h = (blk.norm3(xf.float()) * (1 + c_scale) + c_shift).to(x.dtype).view(b, n, dim)
        y = blk.ffn(h)
        return (xf.float() + y.view(b, f, n // f, dim).float() * c_gate).to(x.dtype).view(b, n, dim)

    def _run(
        self, x: torch.Tensor, t: torch.Tensor, cross: CrossAttnCache, frame_offset: int, attend: AttendFn,
        rope_k: bool = True, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        bsz, _, f, hh, ww = x.shape
        pt, ph, pw = self.config.patch_size
        if pt != 1:
            raise ConfigError("Only temporal patch size 1 is supported (Wan 2.1 uses (1, 2, 2)).")
        if t.shape != (bsz, f):
            raise ConfigError(f"Timesteps must have shape [B, F] = [{bsz}, {f}], got {tuple(t.shape)}.")
        if len(cross) != len(self.blocks):
            raise ConfigError("The cross-attention cache was prepared by a different model.")
        gh, gw = hh // ph, ww // pw
        x = x.to(self.execution_device, self.compute_dtype)
        t = t.to(x.device)
        h = self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        temb, e = self._time(t)
        if rope is None:
            self.check_rope_range(frame_offset + f)
            rope = self._rope(f, gh, gw, frame_offset, h.device)
        checkpointing = getattr(self, "gradient_checkpointing", False) and torch.is_grad_enabled()
        for i, _ in self.iter_blocks():
            if checkpointing:  # training: keep only each layer's input, recompute its inside in backward
                h = torch.utils.checkpoint.checkpoint(self._layer, i, h, e, rope, cross, attend, f, rope_k,
                                                      use_reentrant=False)
            else:
                h = self._layer(i, h, e, rope, cross, attend, f, rope_k)
        # output head with per-frame shift/scale
        n, dim = h.shape[1], h.shape[2]
        shift, scale = (self.scale_shift_table.float().unsqueeze(1) + temb.unsqueeze(2)).unbind(2)
        hf = h.view(bsz, f, n // f, dim)
        h = (self.norm_out(hf.float()) * (1 + scale.unsqueeze(2)) + shift.unsqueeze(2)).to(h.dtype)
        out = self.proj_out(h.view(bsz, n, dim))
        out = out.reshape(bsz, f, gh, gw, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @torch.inference_mode()
    def forward_block(
        self, x: torch.Tensor, t: torch.Tensor, self_kv: SelfKVCache | None, cross: CrossAttnCache, *,
        frame_offset: int = 0, write: bool = True, cache_frame: int | None = None,
    ) -> torch.Tensor:
        """Flow prediction for one block ``x [B,C,f,h,w]`` at per-frame timesteps ``t [B,f]``.

        Queries attend to the cached K/V of earlier frames plus the block itself (no mask). ``frame_offset`` is
        the RoPE frame position of the block's first frame; ``cache_frame`` its logical frame index in the cache
        (defaults to ``frame_offset``). ``write=True`` stores the block's K/V in its slots (same-slot overwrite
        on a re-run); ``write=False`` leaves the cache untouched.
        """
        f = x.shape[2]
        if self_kv is not None and self_kv.rope_on_read:
            return self._forward_window_positions(x, t, self_kv, cross, frame_offset, write, cache_frame)
        if self_kv is None:
            def attend(i, q, k, v):
                return self._sdpa(q, k, v)
        elif write:
            slots = self_kv.begin_write(frame_offset if cache_frame is None else cache_frame, f)

            def attend(i, q, k, v):
                kc, vc = self_kv.layer(i)
                kc[:, slots.start:slots.end].copy_(k)
                vc[:, slots.start:slots.end].copy_(v)
                return self._sdpa(q, kc[:, slots.attend_start:slots.end], vc[:, slots.attend_start:slots.end])
        else:
            prefix = self_kv.prefix_tokens(frame_offset if cache_frame is None else cache_frame)

            def attend(i, q, k, v):
                kc, vc = self_kv.layer(i)
                return self._sdpa(q, torch.cat([kc[:, :prefix], k], 1), torch.cat([vc[:, :prefix], v], 1))

        return self._run(x, t, cross, frame_offset, attend)

    def _forward_window_positions(self, x, t, self_kv: SelfKVCache, cross, frame_offset, write, cache_frame):
        """Window-relative RoPE: the block is roped at its slot in the window, its keys are stored un-roped, and the
        window's keys are roped at their slots (0..) on every read. Bit-identical to absolute positions while no
        frame was evicted (slot == frame index); afterwards positions stay below the window size."""
        f, hh, ww = x.shape[2:]
        _, ph, pw = self.config.patch_size
        tpf = self_kv.tokens_per_frame
        logical = frame_offset if cache_frame is None else cache_frame
        if write:
            slots = self_kv.begin_write(logical, f)
            start, end = slots.start, slots.end
        else:
            start = self_kv.prefix_tokens(logical)
            end = start + f * tpf
        cos, sin = self._rope(end // tpf, hh // ph, ww // pw, 0, self.execution_device)

        def attend(i, q, k, v):
            kc, vc = self_kv.layer(i)
            if write:
                kc[:, start:end].copy_(k)
                vc[:, start:end].copy_(v)
                keys, values = kc[:, :end], vc[:, :end]
            else:
                keys, values = torch.cat([kc[:, :start], k], 1), torch.cat([vc[:, :start], v], 1)
            return self._sdpa(q, self._apply_rope(keys, cos, sin), values)

        return self._run(x, t, cross, start // tpf, attend, rope_k=False)

    def check_rope_range(self, end_frame: int) -> None:
        """Refuse RoPE positions past the model's table (``rope_max_seq_len``): the model never saw them."""
        limit = rope_positions(self.config)
        if end_frame > limit:
            raise ConfigError(f"RoPE frame position {end_frame - 1} is past the model's table of {limit} positions. "
                              "Use window-relative positions (noisy regime, positions='window') or the recompute "
                              "regime for long videos.")

    def forward_train(self, x: torch.Tensor, t: torch.Tensor, cross: CrossAttnCache,
                      frames_per_block: int = 3) -> torch.Tensor:
        """Flow prediction over a whole clip ``x [B,C,F,h,w]``, block-causal, with autograd (training).

        Every frame attends to its own and earlier blocks: exactly what the cached block-by-block forward computes
        when the earlier blocks were cached at the timesteps given for them in ``t``. One attention call per block
        over the keys it sees (:func:`~sdvg.models.block_attention.block_causal_attention`): no ``[L, L]`` mask."""
        f, hh, ww = x.shape[2:]
        block_tokens = frames_per_block * self.tokens_per_frame(hh, ww)

        def attend(i, q, k, v):
            return block_causal_attention(q, k, v, block_tokens)

        return self._run(x, t, cross, 0, attend)

    def forward_with_context(self, ctx: torch.Tensor, t_ctx: torch.Tensor, x: torch.Tensor, t: torch.Tensor,
                             cross: CrossAttnCache, frames_per_block: int = 3) -> torch.Tensor:
        """Flow prediction for every block of ``x [B,C,F,h,w]`` (at ``t [B,F]``) as the cached sampler computes it
        when the cache holds ``ctx`` (at ``t_ctx``) for the earlier blocks: one forward over ``[ctx, x]`` with the
        attention of :func:`~sdvg.models.block_attention.context_mask` (computed per block, no mask built), both
        halves at the same RoPE positions, with autograd (training).

        ``ctx`` = the clean blocks at t = 0 is Self-Forcing's cache (and the teacher's / fake score's view of a
        generated video); ``ctx = x`` at ``t`` is the noisy cache, which :meth:`forward_train` computes more cheaply."""
        f, hh, ww = x.shape[2:]
        _, ph, pw = self.config.patch_size
        self.check_rope_range(f)
        block_tokens = frames_per_block * self.tokens_per_frame(hh, ww)
        cos, sin = self._rope(f, hh // ph, ww // pw, 0, self.execution_device)
        rope = (torch.cat([cos, cos]), torch.cat([sin, sin]))

        def attend(i, q, k, v):
            return context_attention(q, k, v, block_tokens)

        out = self._run(torch.cat([ctx, x], 2), torch.cat([t_ctx, t], 1), cross, 0, attend, rope=rope)
        return out[:, :, f:]

    @torch.inference_mode()
    def forward_blockwise_masked(
        self, x: torch.Tensor, t: torch.Tensor, cross: CrossAttnCache, frames_per_block: int = 3, *,
        frame_offset: int = 0, self_kv: SelfKVCache | None = None, cache_frame: int | None = None,
    ) -> torch.Tensor:
        """Non-cached block-causal forward over ``x [B,C,F,h,w]`` (per-block attention calls, no mask); optionally
        writes all K/V."""
        f, hh, ww = x.shape[2:]
        if self_kv is not None and self_kv.rope_on_read:
            raise ConfigError("forward_blockwise_masked writes roped keys; it cannot fill a window-positions cache.")
        block_tokens = frames_per_block * self.tokens_per_frame(hh, ww)
        slots = None
        if self_kv is not None:
            slots = self_kv.begin_write(frame_offset if cache_frame is None else cache_frame, f)

        def attend(i, q, k, v):
            if slots is not None:
                kc, vc = self_kv.layer(i)
                kc[:, slots.start:slots.end].copy_(k)
                vc[:, slots.start:slots.end].copy_(v)
            return block_causal_attention(q, k, v, block_tokens)

        return self._run(x, t, cross, frame_offset, attend)


def dit_param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The diffusers-named parameter shapes of a DiT with ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = CausalWanTransformer(**config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
