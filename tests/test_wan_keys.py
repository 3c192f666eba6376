"""Wan DiT key layouts and configs: names against the real 1.3B/14B files, both directions of the rename map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdvg.errors import ModelFileError
from sdvg.fixtures import tiny
from sdvg.loaders import wan_keys as wk

DATA = Path(__file__).resolve().parent / "data"


def test_original_key_shapes_match_real_models():
    real = json.loads((DATA / "wan21_t2v_key_shapes.json").read_text())
    for size in ("1.3B", "14B"):
        assert wk.original_key_shapes(wk.config_for_size(size)) == real[size], size


def test_rename_map_inverts_diffusers_converter():
    shapes = wk.original_key_shapes(tiny.TINY_DRAFTER_CONFIG)
    diffusers = wk.original_to_diffusers(dict.fromkeys(shapes, None))
    assert {wk.diffusers_to_original_key(k) for k in diffusers} == set(shapes)


def test_config_from_shapes_both_layouts_and_missing_keys():
    cfg = tiny.TINY_DRAFTER_CONFIG
    original = {k: tuple(v) for k, v in wk.original_key_shapes(cfg).items()}
    heads = cfg["num_attention_heads"]
    assert wk.config_from_shapes(original, "original", heads_hint=heads) == cfg
    diffusers = {k: original[wk.diffusers_to_original_key(k)] for k in wk.original_to_diffusers(dict.fromkeys(original))}
    assert wk.config_from_shapes(diffusers, "diffusers", heads_hint=heads) == cfg
    assert wk.size_label(cfg) == "custom: dim 64, 2 layers" and wk.size_label(wk.config_for_size("14B")) == "14B"
    with pytest.raises(ModelFileError, match="not a multiple of 128"):
        wk.config_from_shapes(original, "original", name="tiny.safetensors")  # dim 64 needs the head count
    with pytest.raises(ModelFileError, match="missing head.head.weight"):
        wk.config_from_shapes({k: v for k, v in original.items() if k != "head.head.weight"}, "original")
