"""The stamps our writers leave in a models tree (``sdvg_<name>.json``: the toy world's, the tiny preset's, the
paper-ratio profile's): one reader for all of them. A stamp is a JSON object; its ``files`` map, where it has one,
names each role's file relative to the tree."""

from __future__ import annotations

import json
from pathlib import Path

STAMP_GLOB = "sdvg_*.json"


def read_stamp(path: str | Path) -> dict:
    """One stamp, parsed (OSError when it cannot be read, ValueError when it is not a JSON object)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def tree_stamps(models_dir: str | Path) -> list[dict]:
    """Every readable stamp of a tree, in name order (an unreadable or broken one is skipped: stamps describe a
    tree, they never stop one from loading)."""
    out = []
    for path in sorted(Path(models_dir).glob(STAMP_GLOB)):
        try:
            out.append(read_stamp(path))
        except (OSError, ValueError):
            continue
    return out
