"""Checkpoint I/O shared by every loader: headers without mapping, safe pickles, unwrapping, prefixes, what a file is."""

from __future__ import annotations

import builtins
import gzip
import json
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sdvg.errors import ModelFileError
from sdvg.loaders import checkpoint as ck
from sdvg.loaders import file_checks as fc
from sdvg.loaders import safetensors_io as stio

GIB = 2**30


def _sparse_safetensors(path: Path, data_bytes: int, metadata: dict[str, str]) -> int:
    """A safetensors file whose header describes ``data_bytes`` of F32 data, written sparse (nothing on disk)."""
    n = data_bytes // 4
    header = {"__metadata__": metadata, "w": {"dtype": "F32", "shape": [n // GIB, GIB], "data_offsets": [0, 4 * n]}}
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + data_bytes)
    return 8 + len(raw)


def _no_mapping(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the header read mapped the file")

    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", refuse)


# ---- safetensors ------------------------------------------------------------------------------------------------


def test_header_of_a_20_gb_file_is_read_without_mapping_it(tmp_path, monkeypatch):
    path = tmp_path / "krea-realtime-video-14b.safetensors"
    start = _sparse_safetensors(path, 20 * GIB, {"sdvg.num_heads": "40", "format": "pt"})
    _no_mapping(monkeypatch)
    header = stio.read_safetensors_header(path)
    assert header.shapes == {"w": (5, GIB)} and header.dtypes == {"w": torch.float32}
    assert header.metadata == {"sdvg.num_heads": "40", "format": "pt"}
    assert header.data_start == start and header.data_len == 20 * GIB and not header.truncated
    header.require_complete()

    with open(path, "r+b") as fh:  # an interrupted download: half of the data is there
        fh.truncate(start + 10 * GIB)
    header = stio.read_safetensors_header(path)
    assert header.truncated and header.metadata["sdvg.num_heads"] == "40"
    with pytest.raises(ModelFileError, match="truncated") as err:
        stio.read_safetensors(path)
    assert path.name in str(err.value) and "download it again" in str(err.value)


def test_metadata_and_tensors_match_safetensors_itself(tmp_path):
    path = tmp_path / "small.safetensors"
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.zeros(2, 2).to(
        torch.float8_e4m3fn)}
    save_file(tensors, str(path), metadata={"k": "v"})
    header = stio.read_safetensors_header(path)
    with safe_open(str(path), "pt") as f:
        assert header.metadata == f.metadata()
    assert header.shapes == {"a": (2, 3), "b": (4,), "c": (2, 2)}
    assert header.dtypes == {"a": torch.float32, "b": torch.bfloat16, "c": torch.float8_e4m3fn}
    some = stio.read_safetensors(path, ["b"])
    assert list(some) == ["b"] and torch.equal(some["b"], tensors["b"])
    loaded = ck.load_checkpoint(path)
    assert loaded.format == "safetensors" and loaded.metadata == {"k": "v"} and torch.equal(loaded.tensors["a"], tensors["a"])


def test_corrupt_header_and_wrong_format(tmp_path):
    (tmp_path / "cut.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        stio.read_safetensors_header(tmp_path / "cut.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "renamed.safetensors")
    with pytest.raises(ModelFileError, match=r"PyTorch checkpoint \(torch.save\).*rename it to \.pt"):
        stio.read_safetensors_header(tmp_path / "renamed.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "renamed.pt"))
    with pytest.raises(ModelFileError, match=r"safetensors file: rename it to \.safetensors"):
        ck.torch_load(tmp_path / "renamed.pt")


# ---- what a file is, from its first bytes -----------------------------------------------------------------------

LOGIN_PAGE = b"""<!DOCTYPE html>
<html class=""><head><meta charset="utf-8"><title>Hugging Face - Log in</title></head><body>...</body></html>"""
LFS_POINTER = b"""version https://git-lfs.github.com/spec/v1
oid sha256:4ad2e5b09b934303ffa0dccc0bacadbb5a9e0df1b4c830a65bdf6193342c1d13
size 28577103288
"""


def _zip_with_readme(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("README.txt", "weights inside")


@pytest.mark.parametrize("content, expected", [
    (b"\x89PNG\r\n\x1a\n" + bytes(64), "this is a PNG image, not a checkpoint"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF" + bytes(64), "this is a JPEG image"),
    (b"GIF89a" + bytes(64), "this is a GIF image"),
    (bytes(4) + b"ftypisom" + bytes(64), "MP4/MOV video"),
    (gzip.compress(b"x" * 100, mtime=0), "gzip archive"),  # mtime 0: the same bytes (and test id) every time
    (LOGIN_PAGE, "HTML web page"),
    (LFS_POINTER, "Git LFS pointer"),
    (b"", "empty (0 bytes)"),
    (None, "ZIP archive (1 file: README.txt), not a PyTorch checkpoint"),
])  # fmt: skip
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_non_checkpoints_are_named(tmp_path, content, expected, suffix):
    path = tmp_path / f"model{suffix}"
    if content is None:
        _zip_with_readme(path)
    else:
        path.write_bytes(content)
    reader = stio.read_safetensors_header if suffix == ".safetensors" else ck.torch_load
    with pytest.raises(ModelFileError) as err:
        reader(path)
    msg = str(err.value)
    assert msg.startswith(str(path)) and expected in msg, msg


def test_lfs_pointer_says_the_file_was_never_downloaded(tmp_path):
    (tmp_path / "ImageReward.pt").write_bytes(LFS_POINTER)
    with pytest.raises(ModelFileError, match=r"real file \(28.58 GB\) was never downloaded.*git lfs pull"):
        ck.load_checkpoint(tmp_path / "ImageReward.pt")


def test_text_and_torch_zips_are_not_sniffed_as_foreign(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "real.pt")
    assert fc.sniff(tmp_path / "real.pt") is None
    (tmp_path / "error.pt").write_text('{"error": "Entry not found"}')
    assert fc.sniff(tmp_path / "error.pt") is None  # text is only a hint when reading fails
    with pytest.raises(ModelFileError, match=r"looks like a text file.*Entry not found") as err:
        ck.torch_load(tmp_path / "error.pt")
    assert "weights_only" in str(err.value)


# ---- torch pickles ------------------------------------------------------------------------------------------------


class _CreatesFile:
    """Unpickling this object opens (creates) ``target`` for writing: code run from a model file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (builtins.open, (self.target, "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    proof = tmp_path / "proof.txt"
    pickle.loads(pickle.dumps(_CreatesFile(str(proof)))).close()  # the payload is live: a plain unpickle runs it
    assert proof.exists()
    target = tmp_path / "pwned.txt"
    torch.save({"w": torch.zeros(2), "x": _CreatesFile(str(target))}, tmp_path / "evil.pt")
    (tmp_path / "raw.ckpt").write_bytes(pickle.dumps(_CreatesFile(str(target))))
    for name in ("evil.pt", "raw.ckpt"):
        with pytest.raises(ModelFileError, match="SDVG never runs code from model files") as err:
            ck.load_checkpoint(tmp_path / name)
        assert name in str(err.value) and "weights_only" in str(err.value)
    assert not target.exists()


def test_legacy_pickles_load_without_mmap(tmp_path):
    sd = {"a.weight": torch.randn(3, 2)}
    torch.save(sd, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    got = ck.load_checkpoint(tmp_path / "legacy.pth")
    assert got.format == "pt" and torch.equal(got.tensors["a.weight"], sd["a.weight"])


def test_truncated_zip_checkpoint_is_corrupt(tmp_path):
    torch.save({"w": torch.randn(256)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        ck.torch_load(tmp_path / "cut.pt")


# ---- training dicts and prefixes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ema_first", [True, False])
def test_generator_ema_is_preferred_over_generator(tmp_path, ema_first):
    gen, ema = {"model.w": torch.zeros(2)}, {"model.w": torch.ones(2)}
    entries = [("generator_ema", ema), ("generator", gen)]
    obj = dict(entries if ema_first else entries[::-1])
    obj.update({"config": {"num_heads": 2}, "step": 7})
    torch.save(obj, tmp_path / "self_forcing_dmd.pt")
    got = ck.load_checkpoint(tmp_path / "self_forcing_dmd.pt")
    assert got.entry == "generator_ema" and torch.equal(got.tensors["model.w"], ema["model.w"])
    assert got.config == {"num_heads": 2} and sorted(got.others) == ["generator", "step"]
    assert "under 'generator_ema'" in ck.describe_checkpoint(got) and "step" in ck.describe_checkpoint(got)


def test_other_wrappers_and_errors(tmp_path):
    sd = {"w": torch.zeros(1)}
    for wrapper in ("state_dict", "model", "module", "ema", "net"):
        got = ck.unwrap_state_dict({wrapper: sd, "epoch": 3}, tmp_path / "x.pt")
        assert got.entry == wrapper and list(got.tensors) == ["w"]
    plain = ck.unwrap_state_dict({**sd, "config": {"a": 1}}, tmp_path / "x.pt")
    assert plain.entry is None and plain.config == {"a": 1} and list(plain.tensors) == ["w"]
    with pytest.raises(ModelFileError, match="holds a list"):
        ck.unwrap_state_dict([torch.zeros(1)], tmp_path / "x.pt")
    with pytest.raises(ModelFileError, match="no tensors found.*step"):
        ck.unwrap_state_dict({"step": 3}, tmp_path / "x.pt")


def test_prefix_stripping():
    keys = ["model.diffusion_model.head.head.weight", "model.diffusion_model.blocks.0.x", "xhead.head.weight",
            "model.diffusion_model.model.head.head.weight"]
    assert ck.prefix_before(keys, "head.head.weight") == "model.diffusion_model."
    assert ck.prefix_before(["head.head.weight"], "head.head.weight") == ""
    assert ck.prefix_before(keys, "nothing") is None
    sd = dict.fromkeys(keys, 0)
    assert set(ck.strip_prefix(sd, "model.diffusion_model.")) == {"head.head.weight", "blocks.0.x",
                                                                  "model.head.head.weight"}
    assert ck.common_prefix(["vae.a", "vae.b"], ("first_stage_model.", "vae.", "model.")) == "vae."
    assert ck.common_prefix(["vae.a", "b"], ("vae.",)) == ""


# ---- what a checkpoint is, from its keys --------------------------------------------------------------------------


@pytest.mark.parametrize("keys, expected", [
    (["lora_unet_blocks_0.lora_down.weight", "x.alpha"], "LoRA"),
    (["shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"], "UMT5/T5 text encoder"),
    (["token_embedding.weight", "blocks.0.attn.q.weight", "blocks.0.pos_embedding.embedding.weight"],
     "Wan UMT5 text encoder (.pth)"),
    (["decoder.middle.0.residual.0.gamma", "conv2.weight"], "a Wan VAE"),
    (["decoder.mid_block.resnets.0.norm1.gamma"], "a Wan VAE"),
    (["encoder.down.0.block.0.norm1.weight", "decoder.up.0.block.0.conv1.weight"], "image (SD/Flux-style) VAE"),
    (["model.diffusion_model.head.modulation", "model.diffusion_model.blocks.0.self_attn.q.weight"], "Wan DiT"),
    (["blip.visual_encoder.blocks.0.attn.qkv.weight", "mlp.layers.0.weight"], "ImageReward/BLIP"),
    (["vision_model.encoder.layers.0.self_attn.q_proj.weight"], "CLIP"),
    (["vace_blocks.0.before_proj.weight", "blocks.0.self_attn.q.weight"], "Wan VACE"),
    (["double_blocks.0.img_attn.qkv.weight"], "different diffusion model"),
    (["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.decoder.up.0.block.0.conv1.weight"],
     "different diffusion model"),
    (["foo.bar"], "an unknown model"),
])  # fmt: skip
def test_looks_like_names_the_kind_and_its_folder(keys, expected):
    what = ck.looks_like(keys)
    assert expected in what, what
    if expected != "an unknown model":
        assert "which goes in models/" in what


def test_dit_training_dicts_are_named_from_their_entry():
    assert "Self-Forcing/CausVid" in ck.looks_like(["x"], entry="generator_ema")
    assert ck.describe_keys(["b.c.d", "b.c.e", "a"]).startswith("3 tensors (first keys: a, b.c.d, b.c.e; top prefixes: b.c.* (2)")


def test_parameters_on_meta_builds_without_memory_and_restores():
    with ck.parameters_on_meta():
        layer = nn.Linear(1024, 1024)
    assert layer.weight.is_meta and isinstance(layer.weight, nn.Parameter)
    assert not nn.Linear(2, 2).weight.is_meta


# ---- wording of refusals ------------------------------------------------------------------------------------------

# torch 2.6+'s text when weights_only=True refuses a global: both pieces of advice would run a malicious payload
TORCH_REFUSAL = (
    "Weights only load failed. This file can still be loaded, to do so you have two options, \x1b[1mdo those steps "
    "only if you trust the source of the checkpoint\x1b[0m. \n\t(1) In PyTorch 2.6, we changed the default value of "
    "the `weights_only` argument in `torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` "
    "set to `False` will likely succeed, but it can result in arbitrary code execution. Do it only if you got the "
    "file from a trusted source.\n\t(2) Alternatively, to load with `weights_only=True` please check the recommended "
    "steps in the following error message.\n\tWeightsUnpickler error: Unsupported global: GLOBAL posix.system was "
    "not an allowed global by default. Please use `torch.serialization.add_safe_globals([posix.system])` or the "
    "`torch.serialization.safe_globals([posix.system])` context manager to allowlist this global if you trust this "
    "class/function.\n\nCheck the documentation of torch.load to learn more about types accepted by default with "
    "weights_only https://pytorch.org/docs/stable/generated/torch.load.html."
)
UNSAFE_ADVICE = ("weights_only=False", "set to `False`", "safe_globals", "allowlist", "trusted source", "Re-running")


def test_safe_detail_keeps_the_reason_and_drops_the_unsafe_advice():
    detail = ck.safe_detail(TORCH_REFUSAL)
    assert "Unsupported global: GLOBAL posix.system was not an allowed global by default" in detail
    assert not any(bad in detail for bad in UNSAFE_ADVICE), detail
    assert "\x1b" not in detail
    assert ck.safe_detail("Unsupported operand 149") == "Unsupported operand 149"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("name", ["evil.pt", "raw.ckpt", "legacy.pth"])
def test_pickle_refusal_never_passes_on_torchs_advice(tmp_path, name):
    target = tmp_path / "pwned.txt"
    payload = {"w": torch.zeros(2), "x": _CreatesFile(str(target))}
    if name == "raw.ckpt":
        (tmp_path / name).write_bytes(pickle.dumps(_CreatesFile(str(target))))
    else:
        torch.save(payload, tmp_path / name, _use_new_zipfile_serialization=name == "evil.pt")
    with pytest.raises(ModelFileError) as err:
        ck.load_checkpoint(tmp_path / name)
    msg = str(err.value)
    assert "SDVG never runs code from model files" in msg and "use a .safetensors version" in msg, msg
    assert not any(bad in msg for bad in UNSAFE_ADVICE), msg
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no traceback quotes torch's text either
    assert not target.exists()


def test_broken_symbolic_links_are_named_with_their_target(tmp_path):
    dangling = tmp_path / "krea.safetensors"
    dangling.symlink_to(tmp_path / "downloads" / "krea.safetensors")
    loop = tmp_path / "loop.pt"
    loop.symlink_to(loop)
    (tmp_path / "models").symlink_to(tmp_path / "unmounted-drive")
    cases = {
        dangling: f"{dangling} is a broken symbolic link: it points to {tmp_path / 'downloads' / 'krea.safetensors'}, "
                  "which is missing",
        loop: f"{loop} is a broken symbolic link: it points to {loop}, which leads back to itself (a loop)",
        tmp_path / "models" / "vae" / "wan_2.1_vae.safetensors":
            f"{tmp_path / 'models'} is a broken symbolic link: it points to {tmp_path / 'unmounted-drive'}",
    }
    for path, expected in cases.items():
        with pytest.raises(ModelFileError) as err:
            fc.require_path(path, "not found")
        assert expected in str(err.value) and "does not exist" not in str(err.value), str(err.value)
        assert "Fix the link" in str(err.value)
    with pytest.raises(ModelFileError, match="^plain missing$"):
        fc.require_path(tmp_path / "nothing.pt", "plain missing")
    (tmp_path / "real.pt").write_bytes(b"x")
    (tmp_path / "good.pt").symlink_to(tmp_path / "real.pt")
    fc.require_path(tmp_path / "good.pt", "not found")
    assert fc.broken_link(tmp_path / "good.pt") is None
