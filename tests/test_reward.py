"""ImageReward on transformers BLIP: scores, reference forward parity, preprocessing, batching, tokenizer, frame errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sdvg.errors import ConfigError
from sdvg.loaders.reward import load_image_reward
from sdvg.models.reward import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_PROMPT_TOKENS,
    REWARD_MEAN,
    REWARD_STD,
    ImageReward,
    ImageRewardConfig,
)
from tests.inputs import frames

PROMPT = "a red car on a city street at night"


# ---- scores -----------------------------------------------------------------------------------------------------


def test_tiny_scores_vary(tiny_reward):
    s = tiny_reward.score(frames(6), PROMPT)
    assert s.shape == (6,) and s.dtype == torch.float32 and s.device.type == "cpu"
    assert torch.isfinite(s).all()
    assert float(s.std()) > 1e-3  # randomized MLP: not the constant -0.1618 of the default init


# ---- batching, chunks, prompt ---------------------------------------------------------------------------------


def test_batched_equals_per_frame_loop(tiny_reward):
    x = frames(7, 40, 56, seed=3)
    batched = tiny_reward.score(x, PROMPT)
    loop = torch.cat([tiny_reward.score(x[i : i + 1], PROMPT) for i in range(7)])
    torch.testing.assert_close(batched, loop, atol=1e-6, rtol=1e-6)
    chunks = list(tiny_reward.score_chunks(x, PROMPT, chunk_size=3))
    assert [len(c) for c in chunks] == [3, 3, 1]
    torch.testing.assert_close(torch.cat(chunks), batched, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tiny_reward.score(x, PROMPT, chunk_size=2), batched, atol=1e-6, rtol=1e-6)


def test_one_forward_for_all_frames(tiny_reward):
    calls = []
    handle = tiny_reward.vision.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        tiny_reward.score(frames(12), PROMPT)
    finally:
        handle.remove()
    assert len(calls) == 1


def test_prompt_tokenized_once(tiny_reward_path):
    model = load_image_reward(tiny_reward_path)
    real = model.tokenizer
    count = {"n": 0}

    class Counting:
        def __call__(self, *a, **kw):
            count["n"] += 1
            return real(*a, **kw)

        def __len__(self):
            return len(real)

    model.tokenizer = Counting()
    for _ in range(3):
        model.score(frames(2), PROMPT)
    model.prepare_prompt(PROMPT)
    assert count["n"] == 1
    model.score(frames(2), "a dog")
    assert count["n"] == 2


def test_prompt_truncated_to_35_tokens(tiny_reward):
    long = " ".join(["cat"] * 100)
    p = tiny_reward.prepare_prompt(long)
    assert p.input_ids.shape == (1, MAX_PROMPT_TOKENS)
    assert int(p.attention_mask.sum()) == MAX_PROMPT_TOKENS
    tok = tiny_reward.tokenizer
    assert int(p.input_ids[0, 0]) == tok.cls_token_id and int(p.input_ids[0, -1]) == tok.sep_token_id
    short = tiny_reward.prepare_prompt("A Cat")  # lowercased
    assert int(short.attention_mask.sum()) == 4
    assert short.input_ids[0, 1:3].tolist() == tok.convert_tokens_to_ids(["a", "cat"])
    assert int(short.input_ids[0, -1]) == tok.pad_token_id
    # [DEC] and [ENC] are added after the vocabulary, as ImageReward does
    assert tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(tok) - 2, len(tok) - 1]
    # the rest of a long prompt changes nothing
    x = frames(2)
    assert torch.equal(tiny_reward.score(x, long), tiny_reward.score(x, long + " dog dog dog"))


# ---- preprocessing --------------------------------------------------------------------------------------------


def _smooth(h, w):
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    img = torch.stack([0.5 + 0.4 * torch.sin(6 * xx + 2 * yy), yy, 0.5 + 0.3 * torch.cos(5 * yy * xx)], -1)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def _pil_reference(img_u8: torch.Tensor, size: int) -> np.ndarray:
    from PIL import Image

    im = Image.fromarray(img_u8.numpy())
    w, h = im.size
    if h <= w:
        nh, nw = size, int(size * w / h)
    else:
        nh, nw = int(size * h / w), size
    im = im.resize((nw, nh), Image.BICUBIC)
    top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
    im = im.crop((left, top, left + size, top + size))
    return np.asarray(im).astype(np.float64)


def _ours_u8_scale(img_u8: torch.Tensor, size: int) -> np.ndarray:
    fake = SimpleNamespace(config=SimpleNamespace(image_size=size), device=torch.device("cpu"))
    x = ImageReward.preprocess(fake, (img_u8.float() / 255)[None])[0]
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return ((x * std + mean) * 255).permute(1, 2, 0).double().numpy()


@pytest.mark.parametrize("h, w, size, mean_tol, max_tol", [
    (480, 832, 224, 0.1, 1.5),   # notes: mean 0.04/255, max 1/255
    (832, 480, 224, 0.1, 1.5),   # portrait
    (480, 832, 32, 0.3, 2.5),    # the tiny model's size (strong downscale)
])  # fmt: skip
def test_preprocess_matches_pil_bicubic(h, w, size, mean_tol, max_tol):
    img = _smooth(h, w)
    ours = _ours_u8_scale(img, size)
    ref = _pil_reference(img, size)
    assert ours.shape == ref.shape == (size, size, 3)
    diff = np.abs(np.round(ours) - ref)  # PIL's output is uint8
    assert diff.mean() < mean_tol and diff.max() < max_tol, (diff.mean(), diff.max())


def test_preprocess_noise_tolerance():
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (480, 832, 3), generator=g, dtype=torch.uint8)
    diff = np.abs(np.round(_ours_u8_scale(img, 224)) - _pil_reference(img, 224))
    assert diff.mean() < 0.5 and diff.max() <= 6  # notes: mean 0.15/255, max 4/255


def test_preprocess_shapes_and_device_input(tiny_reward):
    x = tiny_reward.preprocess(frames(3, 480, 832))
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    # half precision input frames are accepted and converted
    s16 = tiny_reward.score(frames(2).half(), PROMPT)
    s32 = tiny_reward.score(frames(2).half().float(), PROMPT)
    torch.testing.assert_close(s16, s32)


# ---- errors ---------------------------------------------------------------------------------------------------


def test_bad_frames(tiny_reward):
    with pytest.raises(ConfigError, match="255"):
        tiny_reward.score((frames(2) * 255).to(torch.uint8), PROMPT)
    bad = frames(2)
    bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ConfigError, match="NaN"):
        tiny_reward.score(bad, PROMPT)
    bad = frames(2)
    bad[1, 3, 3, 1] = math.inf
    with pytest.raises(ConfigError, match="inf"):
        tiny_reward.score(bad, PROMPT)
    with pytest.raises(ConfigError, match=r"\[0, 1\].*255"):
        tiny_reward.score(frames(2) * 255, PROMPT)
    with pytest.raises(ConfigError, match=r"\[-1, 1\]"):
        tiny_reward.score(frames(2) * 2 - 1, PROMPT)
    with pytest.raises(ConfigError, match=r"\[N, H, W, 3\]"):
        tiny_reward.score(frames(2).permute(0, 3, 1, 2), PROMPT)
    with pytest.raises(ConfigError, match="chunk_size"):
        tiny_reward.score(frames(2), PROMPT, chunk_size=0)
    # a hair outside [0, 1] is tolerated (clamped)
    ok = frames(2)
    ok[0, 0, 0, 0] = 1.0005
    ok[0, 0, 0, 1] = -0.0005
    assert torch.isfinite(tiny_reward.score(ok, PROMPT)).all()


# ---- independent reference forward (original BLIP layout, written from the architecture notes) ----------------


def _reference_scores(state, cfg: ImageRewardConfig, pixels, ids, mask):
    """Timm ViT (pre-norm) + BLIP med BERT (post-norm, self-attn → cross-attn → FFN) + affine MLP head."""
    S = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    v, t = "blip.visual_encoder.", "blip.text_encoder."

    def lin(x, p):
        return x @ S[p + ".weight"].T + S[p + ".bias"]

    def ln(x, p, eps):
        return F.layer_norm(x, x.shape[-1:], S[p + ".weight"], S[p + ".bias"], eps)

    def attend(q, k, vv, heads, bias=None):
        b, lq, c = q.shape
        d = c // heads
        q = q.view(b, lq, heads, d).transpose(1, 2)
        k = k.view(b, -1, heads, d).transpose(1, 2)
        vv = vv.view(b, -1, heads, d).transpose(1, 2)
        a = q @ k.transpose(-1, -2) / math.sqrt(d)
        if bias is not None:
            a = a + bias
        return (a.softmax(-1) @ vv).transpose(1, 2).reshape(b, lq, c)

    x = F.conv2d(pixels.double(), S[v + "patch_embed.proj.weight"], S[v + "patch_embed.proj.bias"],
                 stride=cfg.patch_size).flatten(2).transpose(1, 2)  # fmt: skip
    x = torch.cat([S[v + "cls_token"].expand(x.shape[0], -1, -1), x], 1) + S[v + "pos_embed"]
    for i in range(cfg.vision_depth):
        p = f"{v}blocks.{i}."
        h = ln(x, p + "norm1", 1e-6)
        q, k, vv = lin(h, p + "attn.qkv").chunk(3, -1)
        x = x + lin(attend(q, k, vv, cfg.vision_heads), p + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, p + "norm2", 1e-6), p + "mlp.fc1")), p + "mlp.fc2")
    img = ln(x, v + "norm", 1e-6)

    n = pixels.shape[0]
    ids, mask = ids.expand(n, -1), mask.expand(n, -1)
    pos = torch.arange(ids.shape[1])
    y = S[t + "embeddings.word_embeddings.weight"][ids] + S[t + "embeddings.position_embeddings.weight"][pos]
    y = ln(y, t + "embeddings.LayerNorm", 1e-12)
    bias = (1.0 - mask[:, None, None, :].double()) * -10000.0
    for i in range(cfg.text_layers):
        p = f"{t}encoder.layer.{i}."
        a = attend(lin(y, p + "attention.self.query"), lin(y, p + "attention.self.key"),
                   lin(y, p + "attention.self.value"), cfg.text_heads, bias)  # fmt: skip
        y = ln(lin(a, p + "attention.output.dense") + y, p + "attention.output.LayerNorm", 1e-12)
        a = attend(lin(y, p + "crossattention.self.query"), lin(img, p + "crossattention.self.key"),
                   lin(img, p + "crossattention.self.value"), cfg.text_heads)  # fmt: skip
        y = ln(lin(a, p + "crossattention.output.dense") + y, p + "crossattention.output.LayerNorm", 1e-12)
        f = F.gelu(lin(y, p + "intermediate.dense"))
        y = ln(lin(f, p + "output.dense") + y, p + "output.LayerNorm", 1e-12)
    r = y[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{i}")
    return ((r - REWARD_MEAN) / REWARD_STD).squeeze(-1)


def test_reference_forward_parity(tiny_reward, tiny_reward_path):
    state = torch.load(tiny_reward_path, weights_only=True)
    x = frames(5, 60, 100, seed=7)
    for prompt in (PROMPT, "cat", " ".join(["dog"] * 60)):
        prepared = tiny_reward.prepare_prompt(prompt)
        ref = _reference_scores(state, tiny_reward.config, tiny_reward.preprocess(x), prepared.input_ids, prepared.attention_mask)
        ours = tiny_reward.score(x, prompt)
        torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=1e-5)


def test_router_early_exit_with_score_chunks(tiny_reward):
    from sdvg.sampling.router import FrameScores, Router, RouterConfig

    x = frames(12, 40, 72, seed=11)
    full = tiny_reward.score(x, PROMPT)
    for tau in (float(full.min()) - 1e-3, float(full.median()), float(full.max()) + 1e-3):
        want = Router(RouterConfig(tau=tau)).decide(1, full)
        chunks = FrameScores(12, lambda idx: pytest.fail("scored at once"), lambda: tiny_reward.score_chunks(x, PROMPT, 3))
        got = Router(RouterConfig(tau=tau, early_exit=True)).decide(1, chunks)
        assert got.decision == want.decision
        assert got.scores == pytest.approx(full.tolist()[: len(got.scores)], abs=1e-5)  # fp32: chunk and batch sizes change the reduction order


