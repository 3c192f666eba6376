"""Import the repository as a ComfyUI pack (a package loaded by file path, like ComfyUI does)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK_NAME = "sdvg_pack_under_test"


def load_pack():
    spec = importlib.util.spec_from_file_location(PACK_NAME, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    return module


def submodule(name: str):
    return importlib.import_module(f"{PACK_NAME}.{name}")


def unload_pack() -> None:
    for name in [n for n in sys.modules if n == PACK_NAME or n.startswith(PACK_NAME + ".")]:
        del sys.modules[name]
