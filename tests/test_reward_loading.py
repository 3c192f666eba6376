"""ImageReward checkpoints: the official key layout and its map, config from shapes, file formats, vocab, errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from sdvg.errors import ConfigError, ModelFileError
from sdvg.fixtures.tiny import write_tiny_image_reward
from sdvg.loaders.reward import (
    SAFETENSORS_CONFIG_KEY,
    UNUSED_KEYS,
    check_vocab_size,
    infer_config,
    load_image_reward,
    map_official_keys,
)
from sdvg.models.reward import ImageRewardConfig, build_mlp, build_modules
from tests.inputs import frames

DATA = Path(__file__).resolve().parent / "data"
PROMPT = "a red car on a city street at night"


def _pattern(key: str) -> str:
    return re.sub(r"\.(blocks|layer)\.\d+\.", r".\1.N.", key)


def test_tiny_file_uses_official_layout(tiny_reward_path):
    official = json.loads((DATA / "imagereward_v1_key_shapes.json").read_text())
    state = torch.load(tiny_reward_path, map_location="cpu", weights_only=True)
    assert {_pattern(k) for k in state} == {_pattern(k) for k in official}
    assert tiny_reward_path.name == "sdvg_tiny_image_reward.pt" and tiny_reward_path.parent.name == "image_reward"
    assert tiny_reward_path.stat().st_size < 25e6
    assert tiny_reward_path.with_name("sdvg_tiny_image_reward.vocab.txt").is_file()


def test_tiny_writer_deterministic(tiny_reward_path, tmp_path):
    again = write_tiny_image_reward(tmp_path)
    a = torch.load(tiny_reward_path, weights_only=True)
    b = torch.load(again, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_safetensors_copy_scores_identically(tiny_reward, tiny_reward_path, tmp_path):
    from safetensors.torch import save_file

    state = torch.load(tiny_reward_path, weights_only=True)
    out = tmp_path / "ImageReward.safetensors"
    heads = json.loads(tiny_reward_path.with_name(tiny_reward_path.stem + ".config.json").read_text())
    save_file(state, str(out), metadata={SAFETENSORS_CONFIG_KEY: json.dumps(heads)})
    shutil.copy(tiny_reward_path.with_name(tiny_reward_path.stem + ".vocab.txt"), tmp_path / "vocab.txt")  # plain name
    model = load_image_reward(out)
    assert model.config == tiny_reward.config
    x = frames(5)
    assert torch.equal(model.score(x, PROMPT), tiny_reward.score(x, PROMPT))


def test_a_non_official_checkpoint_without_its_head_counts_is_refused(tiny_reward_path, tmp_path):
    """Shapes cannot tell a head count: the tiny model's 2 heads are in its sidecar; without it, width // 64 would
    be a silent guess (1 head), so the file is refused naming the sidecar to write."""
    shutil.copy(tiny_reward_path, tmp_path / "m.pt")
    shutil.copy(tiny_reward_path.with_name(tiny_reward_path.stem + ".vocab.txt"), tmp_path / "vocab.txt")
    with pytest.raises(ModelFileError, match=r"head counts cannot be read .* Put m\.config\.json beside it"):
        load_image_reward(tmp_path / "m.pt")
    (tmp_path / "m.config.json").write_text('{"vision_heads": 2, "text_heads": 12}')
    assert load_image_reward(tmp_path / "m.pt").config.vision_heads == 2


def test_full_size_key_map_parity_on_meta():
    shapes = json.loads((DATA / "imagereward_v1_key_shapes.json").read_text())
    assert len(shapes) == 625
    state = {k: torch.empty(v, device="meta") for k, v in shapes.items()}
    cfg = infer_config({k: tuple(v) for k, v in shapes.items()})
    assert cfg == ImageRewardConfig()  # ViT-L/16 224, 16 heads, BERT-base 12 layers, vocab 30524
    mapped = map_official_keys(state)
    assert not mapped.unknown
    assert sorted(mapped.dropped) == sorted(UNUSED_KEYS)
    with torch.device("meta"):
        vision, text = build_modules(cfg)
        mlp = build_mlp()
    for module, sub in ((vision, mapped.vision), (text, mapped.text), (mlp, mapped.mlp)):
        want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in sub.items()}
        assert set(got) == set(want), (set(want) - set(got), set(got) - set(want))
        assert got == want
        result = module.load_state_dict(sub, strict=True, assign=True)
        assert not result.missing_keys and not result.unexpected_keys
    n_params = sum(v.numel() for k, v in state.items() if k not in UNUSED_KEYS)
    assert 440e6 < n_params < 450e6


def test_missing_vocab(tiny_reward_path, tmp_path):
    shutil.copy(tiny_reward_path, tmp_path / "ImageReward.pt")
    with pytest.raises(ModelFileError) as err:
        load_image_reward(tmp_path / "ImageReward.pt")
    msg = str(err.value)
    assert str(tmp_path / "vocab.txt") in msg and "bert-base-uncased" in msg and "30,522" in msg


def test_vocab_size_mismatch(tiny_reward_path, tmp_path):
    shutil.copy(tiny_reward_path, tmp_path / "ImageReward.pt")
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncat\n")
    with pytest.raises(ModelFileError, match=r"vocab.txt has 6 lines, but ImageReward.pt has \d+ word embeddings, so "
                                             r"its vocabulary has \d+ lines .*bert-base-uncased's has 30,522"):
        load_image_reward(tmp_path / "ImageReward.pt")


@pytest.mark.parametrize("content, expected", [
    (b"", "vocab.txt is empty (0 bytes"),
    (b"\n\n\n", "vocab.txt is empty (3 blank lines, no tokens)"),
    (b"  \r\n\t\r\n", "vocab.txt is empty (2 blank lines, no tokens)"),
    ("[PAD]\ncaf\u00e9\n".encode("latin-1"), "vocab.txt is not UTF-8 text (byte 0xe9 at offset 9)"),
])  # fmt: skip
def test_empty_or_unreadable_vocab_says_so(tiny_reward_path, tmp_path, content, expected):
    shutil.copy(tiny_reward_path, tmp_path / "ImageReward.pt")
    (tmp_path / "vocab.txt").write_bytes(content)
    with pytest.raises(ModelFileError) as err:
        load_image_reward(tmp_path / "ImageReward.pt")
    msg = str(err.value)
    assert expected in msg and str(tmp_path / "vocab.txt") in msg and "30,522 lines" in msg, msg
    assert "from vocab.txt" not in msg


def test_official_checkpoint_with_a_short_vocab_names_both_line_counts(tmp_path):
    official = ImageRewardConfig()  # bert-base-uncased: 30,522 words + [DEC], [ENC]
    for n in (5, 30521, 30600):
        with pytest.raises(ModelFileError, match=f"vocab.txt has {n:,} lines, bert-base-uncased's has 30,522"):
            check_vocab_size(["x"] * n, tmp_path / "vocab.txt", official, Path("ImageReward.pt"))
    check_vocab_size(["x"] * 30522, tmp_path / "vocab.txt", official, Path("ImageReward.pt"))


def test_broken_link_to_the_checkpoint_or_vocab_names_its_target(tiny_reward_path, tmp_path):
    (tmp_path / "ImageReward.pt").symlink_to(tmp_path / "downloads" / "ImageReward.pt")
    with pytest.raises(ModelFileError, match="ImageReward.pt is a broken symbolic link") as err:
        load_image_reward(tmp_path / "ImageReward.pt")
    assert str(tmp_path / "downloads" / "ImageReward.pt") in str(err.value) and "not found" not in str(err.value)
    (tmp_path / "vocab.txt").symlink_to(tmp_path / "bert" / "vocab.txt")
    with pytest.raises(ModelFileError, match="vocab.txt is a broken symbolic link") as err:
        load_image_reward(tiny_reward_path, vocab=tmp_path / "vocab.txt")
    assert str(tmp_path / "bert" / "vocab.txt") in str(err.value)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_png_renamed_as_image_reward_is_called_a_png_image(tmp_path, suffix):
    from PIL import Image

    path = tmp_path / f"ImageReward{suffix}"
    Image.new("RGB", (8, 8), "red").save(path, format="PNG")
    with pytest.raises(ModelFileError, match="this is a PNG image, not a checkpoint") as err:
        load_image_reward(path)
    assert str(path) in str(err.value) and "truncated" not in str(err.value)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ModelFileError, match="not found.*ImageReward.pt"):
        load_image_reward(tmp_path / "nope.pt")


def test_wrong_checkpoint_wan_file(tmp_path):
    from safetensors.torch import save_file

    wan = {
        "model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(4, 4),
        "model.diffusion_model.patch_embedding.weight": torch.zeros(4, 16, 1, 2, 2),
        "model.diffusion_model.head.head.weight": torch.zeros(4, 4),
    }
    path = tmp_path / "wan2.1_t2v_1.3B_bf16.safetensors"
    save_file(wan, str(path))
    with pytest.raises(ModelFileError) as err:
        load_image_reward(path)
    msg = str(err.value)
    assert path.name in msg and "not an ImageReward checkpoint" in msg and "model.diffusion_model" in msg
    torch.save({"generator": {"x": torch.zeros(1)}}, tmp_path / "self_forcing_dmd.pt")
    with pytest.raises(ModelFileError, match="self_forcing_dmd.pt"):
        load_image_reward(tmp_path / "self_forcing_dmd.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a pickle")
    with pytest.raises(ModelFileError, match="weights_only"):
        load_image_reward(tmp_path / "garbage.pt")


def test_incomplete_checkpoint_is_refused(tiny_reward_path, tmp_path):
    state = torch.load(tiny_reward_path, weights_only=True)
    del state["blip.text_encoder.encoder.layer.0.crossattention.self.key.weight"]
    state["blip.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pt")
    shutil.copy(tiny_reward_path.with_name(tiny_reward_path.stem + ".vocab.txt"), tmp_path / "vocab.txt")
    with pytest.raises(ModelFileError, match="unexpected tensors.*blip.extra.weight"):
        load_image_reward(tmp_path / "bad.pt")
    del state["blip.extra.weight"]
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ModelFileError, match="crossattention.self.key.weight"):
        load_image_reward(tmp_path / "bad.pt")


def test_load_dtype_and_device_strings(tiny_reward, tiny_reward_path):
    m = load_image_reward(tiny_reward_path, device="auto" if not torch.cuda.is_available() else "cpu", dtype="bf16")
    assert m.dtype == torch.bfloat16 and m.mlp[0].weight.dtype == torch.float32  # head stays fp32
    x = frames(3)
    s = m.score(x, PROMPT)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()
    assert float((s - tiny_reward.score(x, PROMPT)).abs().max()) < 0.1  # bf16 trunk vs fp32
    with pytest.raises(ConfigError, match="fp8"):
        load_image_reward(tiny_reward_path, dtype="fp8_e4m3fn")
    with pytest.raises(ConfigError, match="device"):
        load_image_reward(tiny_reward_path, device="tpu:7")


def test_legacy_pickle_format_loads(tiny_reward, tiny_reward_path, tmp_path):
    state = torch.load(tiny_reward_path, weights_only=True)
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    shutil.copy(tiny_reward_path.with_name(tiny_reward_path.stem + ".config.json"), tmp_path / "legacy.config.json")
    model = load_image_reward(tmp_path / "legacy.pt", vocab=tiny_reward_path.with_name(tiny_reward_path.stem + ".vocab.txt"))
    x = frames(2)
    assert torch.equal(model.score(x, PROMPT), tiny_reward.score(x, PROMPT))
