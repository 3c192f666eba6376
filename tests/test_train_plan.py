"""The FSDP memory plan for Diagonal Distillation of the real 1.3B: parameter count, sharding, activations, table."""

from __future__ import annotations

import math

import pytest

from sdvg.errors import ConfigError
from sdvg.train.plan import ITEMS, WAN_1P3B, dit_param_count, format_plan, memory_plan

GPUS = (1, 2, 4, 8)


def test_1p3b_parameter_count():
    params, block = dit_param_count(WAN_1P3B)
    assert 1.2e9 < params < 1.5e9
    assert 0 < block * WAN_1P3B["num_layers"] < params


def test_total_falls_with_gpus_activations_do_not():
    plans = [memory_plan(config=WAN_1P3B, gpus=g) for g in GPUS]
    totals = [p["total"] for p in plans]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)
    assert len({p["activations"] for p in plans}) == 1
    assert len({p["kv_cache"] for p in plans}) == 1 and len({p["gathered_blocks"] for p in plans}) == 1
    for p in plans:
        assert p["total"] == sum(p[key] for key, _ in ITEMS)


def test_gradient_checkpointing_lowers_activations():
    on = memory_plan(config=WAN_1P3B, gpus=8, gradient_checkpointing=True)
    off = memory_plan(config=WAN_1P3B, gpus=8, gradient_checkpointing=False)
    assert on["activations"] < off["activations"]
    assert on["total"] - on["activations"] == off["total"] - off["activations"]
    single = memory_plan(config=WAN_1P3B, gpus=8, context_forward=False)
    assert single["sequence"] == single["tokens"] == on["sequence"] // 2
    assert single["activations"] * 2 == on["activations"]


def test_hand_computed_items():
    for gpus in GPUS:
        p = memory_plan(config=WAN_1P3B, gpus=gpus, batch_per_gpu=2)
        params, block = p["params"], p["block_params"]
        assert (params, block) == dit_param_count(WAN_1P3B)
        assert p["teacher"] == math.ceil(params * 2 / gpus)
        assert p["student"] == p["fake_score"] == math.ceil(params * 16 / gpus)
        assert p["student_ema"] == math.ceil(params * 4 / gpus)
        assert p["gathered_blocks"] == 2 * block * 2
        dim, ffn, layers = 12 * 128, 8960, 30
        tokens = 21 * 30 * 52
        assert p["tokens"] == tokens and p["sequence"] == 2 * tokens
        assert p["activations"] == layers * 2 * (2 * tokens) * dim * 2 + 2 * (2 * tokens) * (8 * dim + ffn) * 2
        assert p["kv_cache"] == layers * 2 * 2 * tokens * dim * 2
        assert p["text_embeddings"] == 2 * 512 * 4096 * 2 * 2


def test_format_plan_is_labelled_and_has_one_column_per_plan():
    plans = [memory_plan(config=WAN_1P3B, gpus=g) for g in GPUS]
    text = format_plan(plans)
    lines = text.splitlines()
    assert "estimate" in lines[0].lower() and "not a measurement" in lines[0]
    header = next(line for line in lines if line.startswith("item"))
    assert header.split()[1:] == ["1", "GPU", "2", "GPUs", "4", "GPUs", "8", "GPUs"]
    total = next(line for line in lines if line.startswith("total"))
    assert [float(v) for v in total.split()[1:]] == [round(p["total"] / 1024**3, 2) for p in plans]
    for _, label in ITEMS:
        row = next(line for line in lines if line.startswith(label))
        assert len(row[len(label):].split()) == len(plans)


def test_bad_arguments():
    with pytest.raises(ConfigError):
        memory_plan(config=WAN_1P3B, gpus=0)
    with pytest.raises(ConfigError):
        memory_plan(config=WAN_1P3B, gpus=1, latent_hw=(61, 104))
    with pytest.raises(ConfigError):
        format_plan([])
