"""One JSON convention for the whole project: strict JSON (no NaN/Infinity literals), non-finite floats as the
strings ``"nan"``, ``"inf"`` and ``"-inf"``, tensors as lists, enums as their values."""

from __future__ import annotations

import math
from enum import Enum
from typing import Any


def json_float(value: float | None) -> float | str | None:
    """A float for strict JSON: finite floats unchanged, NaN → ``"nan"``, ±inf → ``"inf"`` / ``"-inf"``."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def from_json_float(value: Any) -> float | None:
    """The inverse of :func:`json_float` (numbers and the three strings; anything else is None)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}.get(value)
    return float(value)


def to_jsonable(value: Any) -> Any:
    """``value`` with every nested float made strict-JSON safe, tensors turned into lists and enums into values."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, Enum):
        return to_jsonable(value.value)
    tolist = getattr(value, "tolist", None)  # torch tensors, numpy arrays and scalars
    if callable(tolist):
        return to_jsonable(tolist())
    return value
