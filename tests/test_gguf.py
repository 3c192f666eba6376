"""GGUF DiTs (city96's layout) on tiny files written with gguf's own writer: the torch dequant kernels against gguf's
numpy reference, the forward against a forward with the dequantized weights, offload of quantized blocks, inspect."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdvg.errors import ModelFileError
from sdvg.fixtures.quant_files import gguf_dequantized_state, write_gguf_dit
from sdvg.fixtures.tiny import TINY_DRAFTER_CONFIG, TINY_TARGET_CONFIG, random_original_state_dict
from sdvg.loaders.dit_build import build_dit_from_state_dict
from sdvg.loaders.model_info import describe_model_file
from sdvg.loaders.wan import inspect_dit_checkpoint, load_dit
from sdvg.loaders.wan_keys import original_to_diffusers
from sdvg.models.quant import GGML_TYPES, QuantLinear, dequantize_blocks, quant_summary

gguf = pytest.importorskip("gguf")

HEADS = TINY_TARGET_CONFIG["num_attention_heads"]
# the target's blocks in Q4_K with a Q6_K and a Q5_K layer (a Q4_K_M-like mix: the streamed blocks differ in layout)
MIX = {"blocks.1.ffn.2.weight": "Q6_K", "blocks.2.self_attn.q.weight": "Q5_K", "blocks.3.cross_attn.v.weight": "Q4_0"}


@pytest.mark.parametrize("name", [k.name for k in GGML_TYPES.values() if k.kernel is not None])
def test_torch_kernels_equal_gguf_numpy_dequantize_on_random_bytes(name):
    """Every byte pattern (random scales included, NaN/inf where a random f16 scale is one) dequantizes to exactly
    gguf's numpy values."""
    qtype = gguf.GGMLQuantizationType[name]
    kind = GGML_TYPES[int(qtype)]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (64, kind.block_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random f16 scales include NaN and inf
        ref = gguf.quants.dequantize(raw, qtype).reshape(-1)
    got = dequantize_blocks(torch.from_numpy(raw), int(qtype), (64 * kind.block_values,)).numpy()
    np.testing.assert_array_equal(got, ref)  # NaNs at the same places count as equal


def _calls(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 4, 6, generator=gen)
    emb = torch.randn(1, 7, model.config.text_dim, generator=gen)
    cross = model.prepare_cross_attention(emb)
    kv = model.new_kv_cache(batch=1, latent_hw=(4, 6), capacity_frames=6)
    t = torch.full((1, 3), 700.0)
    return [*cross.k, model.forward_block(x, t, kv, cross), model.forward_block(x * 0.5, t, kv, cross, frame_offset=3)]


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny_target-Q4_K_M.gguf"
    stored = write_gguf_dit(path, random_original_state_dict(TINY_TARGET_CONFIG, seed=7), qtype="Q4_K", types=MIX,
                            num_heads=HEADS, seed=7)
    return path, stored


def _reference(path, config, dtype):
    sd = original_to_diffusers(gguf_dequantized_state(path))
    return build_dit_from_state_dict(sd, config, dtype=dtype, name="dequantized reference")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", [None, 1])
def test_gguf_target_forward_equals_the_dequantized_forward_bit_for_bit(target_gguf, dtype, offload):
    path, stored = target_gguf
    assert {"Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "F32"} <= set(stored.values())
    model = load_dit(path, dtype=dtype, device="cpu", offload_blocks=offload)
    ref = _reference(path, TINY_TARGET_CONFIG, torch.float32 if dtype == "fp32" else torch.bfloat16)
    layers = quant_summary(model)
    assert layers["Q4_K"] >= 30 and layers["Q5_K"] == layers["Q6_K"] == layers["Q4_0"] == 1
    assert isinstance(model.blocks[2].attn1.to_q, QuantLinear) and model.blocks[2].attn1.to_q.weight.dtype == torch.uint8
    for a, b in zip(_calls(model), _calls(ref), strict=True):
        assert torch.equal(a, b)
    if offload is not None:  # the streamed blocks' parameters are the quantized bytes
        off = model.block_offloader
        assert off.streamed == 3 and off.block_bytes < sum(p.numel() * 4 for p in ref.blocks[1].parameters()) / 4


def test_the_quantized_model_holds_the_stored_bytes_not_the_dequantized_weights(target_gguf):
    path, _ = target_gguf
    model = load_dit(path, dtype="fp32")
    info = inspect_dit_checkpoint(path)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == info.device_bytes(torch.float32)
    assert held < 0.25 * info.num_params * 4  # Q4_K is 4.5 bits a weight; fp32 would be 32


def test_gguf_drafter_q8_0_matches_and_prefix_is_stripped(tmp_path):
    path = tmp_path / "tiny_drafter-Q8_0.gguf"
    sd = random_original_state_dict(TINY_DRAFTER_CONFIG, seed=3)
    write_gguf_dit(path, sd, qtype="Q8_0", num_heads=TINY_DRAFTER_CONFIG["num_attention_heads"],
                   prefix="model.diffusion_model.")
    model = load_dit(path, dtype="fp32")
    assert quant_summary(model)["Q8_0"] >= 10
    ref_sd = {k.removeprefix("model.diffusion_model."): v for k, v in gguf_dequantized_state(path).items()}
    ref = build_dit_from_state_dict(original_to_diffusers(ref_sd), TINY_DRAFTER_CONFIG, dtype=torch.float32)
    for a, b in zip(_calls(model), _calls(ref), strict=True):
        assert torch.equal(a, b)
    # Q8_0 of the given weights: within half a quantization step of the originals
    w = sd["blocks.0.self_attn.q.weight"]
    got = model.blocks[0].attn1.to_q.dequantized()
    assert (got - w).abs().max() <= w.abs().max() / 127 * 0.51 + 1e-6


def test_inspect_reports_the_quant_types_and_the_memory_per_role(target_gguf):
    path, _ = target_gguf
    text = describe_model_file(path)
    assert "from gguf" in text and "Q4_K" in text and "Q6_K (1 tensors)" in text
    assert "stay quantized on the device" in text and "on a GPU (bf16 compute)" in text


def test_bad_gguf_files_are_named(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        inspect_dit_checkpoint(junk)
    llama = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(llama), arch="llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="'llama' architecture"):
        load_dit(llama)
    with pytest.raises(ModelFileError, match="'llama' architecture"):  # inspect says so too (no pickle guess)
        describe_model_file(llama)
    cut = tmp_path / "cut.gguf"
    write_gguf_dit(cut, random_original_state_dict(TINY_DRAFTER_CONFIG, seed=1), num_heads=2)
    with open(cut, "r+b") as fh:
        fh.truncate(cut.stat().st_size - 1000)
    with pytest.raises(ModelFileError, match="not a readable GGUF file.*incomplete"):
        load_dit(cut)


def test_types_without_a_torch_kernel_are_dequantized_once_at_load_by_gguf(tmp_path):
    path = tmp_path / "mixed.gguf"
    sd = random_original_state_dict(TINY_DRAFTER_CONFIG, seed=4)
    stored = write_gguf_dit(path, sd, qtype="Q8_0", types={"blocks.0.self_attn.q.weight": "Q5_0",
                                                           "blocks.1.ffn.0.weight": "Q4_1"},
                            num_heads=TINY_DRAFTER_CONFIG["num_attention_heads"])
    assert stored["blocks.0.self_attn.q.weight"] == "Q5_0"
    info = inspect_dit_checkpoint(path)
    assert info.quant["Q5_0"] == info.quant["Q4_1"] == 1
    model = load_dit(path, dtype="fp32")
    assert type(model.blocks[0].attn1.to_q) is torch.nn.Linear and isinstance(model.blocks[0].attn1.to_k, QuantLinear)
    ref = build_dit_from_state_dict(original_to_diffusers(gguf_dequantized_state(path)), TINY_DRAFTER_CONFIG,
                                    dtype=torch.float32)
    for a, b in zip(_calls(model), _calls(ref), strict=True):
        assert torch.equal(a, b)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == info.device_bytes(torch.float32)


def test_a_lora_on_a_gguf_dit_merges_into_the_dequantized_weights_it_touches(tmp_path):
    from sdvg.fixtures.loras import lora_factors, write_lora
    from sdvg.loaders.lora import LoraSpec

    path = tmp_path / "d.gguf"
    write_gguf_dit(path, random_original_state_dict(TINY_DRAFTER_CONFIG, seed=6), qtype="Q8_0",
                   num_heads=TINY_DRAFTER_CONFIG["num_attention_heads"])
    factors = {k: v for k, v in lora_factors(TINY_DRAFTER_CONFIG, seed=2).items() if k.startswith("blocks.0.")}
    lora = write_lora(tmp_path / "l.safetensors", factors, "kohya")
    model = load_dit(path, dtype="fp32", loras=[LoraSpec(lora, 0.5)])
    ref = original_to_diffusers(gguf_dequantized_state(path))
    for module, (up, down, alpha) in factors.items():
        ref[module + ".weight"] = ref[module + ".weight"] + (up @ down) * (0.5 * alpha / down.shape[0])
    got = dict(model.named_parameters())
    for module in factors:  # touched: dense, merged in fp32
        assert torch.equal(got[module + ".weight"], ref[module + ".weight"])
    assert isinstance(model.blocks[1].attn1.to_q, QuantLinear)  # untouched: still quantized
    assert type(model.blocks[0].attn1.to_q) is torch.nn.Linear
