"""UMT5 text encoder: Comfy-Org / Wan .pth / Hugging Face folder layouts, local tokenizer, padding, cache."""

from __future__ import annotations

import hashlib
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdvg.errors import ModelFileError
from sdvg.fixtures import tiny
from sdvg.loaders import text_encoder as te

PROMPT = "A red fox runs through fresh snow at sunrise."


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the text encoder tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    return tiny.write_tiny_text_encoder(tmp_path_factory.mktemp("models"))["text_encoder"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, comfy):
    """The tiny weights in the Wan .pth layout and as a Hugging Face folder, tokenizer beside them."""
    d = tmp_path_factory.mktemp("layouts")
    raw = load_file(comfy)
    spiece = raw.pop(te.SPIECE_KEY).numpy().tobytes()
    wan_dir = d / "wan"
    wan_dir.mkdir()
    torch.save({k: v.to(torch.bfloat16) for k, v in te.hf_to_wan_t5(raw).items()}, wan_dir / "umt5_enc.pth")
    (wan_dir / "google" / "umt5-xxl").mkdir(parents=True)
    (wan_dir / "google" / "umt5-xxl" / "spiece.model").write_bytes(spiece)
    torch.save(te.hf_to_wan_t5(raw), wan_dir / "models_t5_umt5-xxl-enc-fp32.pth")
    hf = d / "hf"
    hf.mkdir()
    enc = te.load_text_encoder(comfy, device="cpu")
    enc.model.config.save_pretrained(hf)
    save_file(raw, hf / "model.safetensors")
    (hf / "spiece.model").write_bytes(spiece)
    return {"wan": wan_dir / "models_t5_umt5-xxl-enc-fp32.pth", "wan_bf16": wan_dir / "umt5_enc.pth", "hf": hf,
            "spiece": spiece, "raw": raw}


def test_layouts_give_identical_embeddings(comfy, layouts):
    ref = te.load_text_encoder(comfy, device="cpu", dtype="fp32").encode(PROMPT)
    for key in ("wan", "hf"):
        out = te.load_text_encoder(layouts[key], device="cpu", dtype="fp32").encode(PROMPT)
        assert torch.equal(out, ref), key
    bf16 = te.load_text_encoder(layouts["wan_bf16"], device="cpu", dtype="bf16").encode(PROMPT)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == ref.shape
    assert torch.isfinite(ref).all() and ref.abs().max() < 50


def test_shape_padding_and_cache(comfy):
    enc = te.load_text_encoder(comfy, device="cpu", cache_size=2)
    assert enc.text_dim == tiny.TINY_TEXT_DIM == tiny.TINY_TARGET_CONFIG["text_dim"] == tiny.TINY_DRAFTER_CONFIG["text_dim"]
    out = enc.encode(PROMPT)
    n = len(enc.tokenizer.ids(PROMPT))
    assert out.shape == (1, 512, enc.text_dim) and out.dtype == torch.float32
    assert out[0, n:].abs().sum() == 0 and (out[0, :n].abs().sum(-1) > 0).all()
    assert enc.tokenizer.ids(PROMPT)[-1] == enc.tokenizer.eos_id
    assert enc.encode(PROMPT) is out
    enc.encode("one")
    enc.encode("two")  # evicts PROMPT (LRU of 2)
    again = enc.encode(PROMPT)
    assert again is not out and torch.equal(again, out)
    assert len(enc.tokenizer.ids("word " * 2000)) == 512


def test_tiny_writer_is_deterministic(tmp_path, comfy):
    again = tiny.write_tiny_text_encoder(tmp_path)["text_encoder"]
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(comfy.read_bytes()).digest()
    assert comfy.stat().st_size < 2e6


@pytest.mark.parametrize("layout", ["scale_weight", "weight_scale"])
def test_scaled_fp8_is_dequantized(tmp_path, comfy, layouts, layout):
    """Both ComfyUI layouts: ``X.scale_weight`` + the ``scaled_fp8`` marker, ``X.weight_scale`` + ``X.comfy_quant``."""
    raw = dict(layouts["raw"])
    scaled = {}
    for k, v in raw.items():
        if v.ndim == 2 and "SelfAttention" in k:
            s = v.abs().max() / 448.0
            scaled[k] = (v / s).to(torch.float8_e4m3fn)
            stem = k[: -len(".weight")]
            scaled[f"{stem}.{layout}"] = s.reshape(1) if layout == "scale_weight" else s
            if layout == "weight_scale":
                scaled[f"{stem}.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        else:
            scaled[k] = v
    if layout == "scale_weight":
        scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    scaled[te.SPIECE_KEY] = torch.frombuffer(bytearray(layouts["spiece"]), dtype=torch.uint8)
    save_file(scaled, tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    ref = te.load_text_encoder(comfy, device="cpu").encode(PROMPT)
    out = te.load_text_encoder(tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors", device="cpu").encode(PROMPT)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_missing_tokenizer_is_named(tmp_path, layouts):
    lone = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    lone.write_bytes(layouts["wan"].read_bytes())
    with pytest.raises(ModelFileError, match="spiece.model or tokenizer.json"):
        te.load_text_encoder(lone, device="cpu")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "spiece.model").write_bytes(layouts["spiece"])
    enc = te.load_text_encoder(lone, device="cpu", tokenizer=tmp_path / "tok")
    assert enc.encode(PROMPT).shape == (1, 512, tiny.TINY_TEXT_DIM)


def test_tokenizer_json(tmp_path, layouts):
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(layouts["spiece"])
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    lt = te.read_tokenizer(tmp_path / "tokenizer.json")
    ids = lt.ids(PROMPT)
    assert ids[-1] == 1 and ids.count(1) == 1
    assert ids == list(sp.encode(PROMPT)) + [1]


def test_bad_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        te.load_text_encoder(tmp_path / "nope.safetensors", device="cpu")
    save_file({"decoder.middle.0.residual.0.gamma": torch.zeros(2)}, tmp_path / "vae.safetensors")
    with pytest.raises(ModelFileError, match="not a UMT5 text encoder.*VAE"):
        te.load_text_encoder(tmp_path / "vae.safetensors", device="cpu")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ModelFileError, match="corrupt"):
        te.load_text_encoder(tmp_path / "cut.safetensors", device="cpu")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ModelFileError, match="config.json"):
        te.load_text_encoder(tmp_path / "folder", device="cpu")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth"])
def test_png_renamed_as_a_text_encoder_is_called_a_png_image(tmp_path, suffix):
    from PIL import Image

    path = tmp_path / f"umt5_xxl_fp8_e4m3fn_scaled{suffix}"
    Image.new("RGB", (8, 8), "red").save(path, format="PNG")
    with pytest.raises(ModelFileError, match="this is a PNG image, not a checkpoint") as err:
        te.load_text_encoder(path, device="cpu")
    assert str(path) in str(err.value) and "truncated" not in str(err.value)


def test_broken_links_to_the_encoder_or_its_tokenizer_name_their_target(tmp_path, layouts):
    link = tmp_path / "umt5_xxl.safetensors"
    link.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ModelFileError, match="is a broken symbolic link") as err:
        te.load_text_encoder(link, device="cpu")
    assert str(tmp_path / "elsewhere.safetensors") in str(err.value) and "not found" not in str(err.value)
    (tmp_path / "spiece.model").symlink_to(tmp_path / "moved" / "spiece.model")
    with pytest.raises(ModelFileError, match="is a broken symbolic link") as err:
        te.load_text_encoder(layouts["wan"], device="cpu", tokenizer=tmp_path / "spiece.model")
    assert str(tmp_path / "moved" / "spiece.model") in str(err.value)
