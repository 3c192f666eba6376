"""One JSON convention: non-finite floats as strings, everywhere a report or an event is written."""

from __future__ import annotations

import json
import math

import torch

from sdvg.jsonable import from_json_float, json_float, to_jsonable
from sdvg.sampling.regimes import CacheRegime
from sdvg.sampling.results import BlockRecord


def test_non_finite_floats_become_strings_and_come_back():
    for value in (math.inf, -math.inf, 1.5, None):
        assert from_json_float(json_float(value)) == value
    assert json_float(math.nan) == "nan" and math.isnan(from_json_float("nan"))


def test_nested_values_are_strict_json():
    data = {"q": math.nan, "scores": [math.inf, 0.5], "t": torch.tensor([1.0, -math.inf]), "regime": CacheRegime.NOISY,
            "n": (1, True, None)}
    out = to_jsonable(data)
    assert out == {"q": "nan", "scores": ["inf", 0.5], "t": [1.0, "-inf"], "regime": "noisy", "n": [1, True, None]}
    json.dumps(out, allow_nan=False)


def test_block_records_with_a_nan_score_serialize():
    record = BlockRecord(block=1, decision="reject", reason="non-finite frame score", produced_by="target", steps=4,
                         q=math.nan, scores=[math.nan, 0.1], tau=-0.7)
    data = json.loads(json.dumps(record.to_dict(), allow_nan=False))
    assert data["q"] == "nan" and data["scores"] == ["nan", 0.1] and data["tau"] == -0.7
