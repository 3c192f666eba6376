"""Package facades that import on first use (PEP 562), as diffusers' pipeline packages do.

Each subpackage's ``__init__.py`` names its public API, submodule by submodule; ``from sdvg.sampling import REGIMES``
then imports ``sampling.regimes`` alone, and ``from sdvg.sampling import SpeculativeSampler`` the sampler with what
it needs (the DiT, hence diffusers). So the ComfyUI nodes and the CLI can import from the facades at module level and
still load nothing heavy until a node runs, and a package's modules never load each other through their facade.

The facade is a view, never a copy: each use reads the name from its module (so a test that patches
``sdvg.loaders.bundle.load_models`` patches what ``from sdvg.loaders import load_models`` gives). An exported
name never equals a submodule's name: once that submodule is imported, Python binds the name on the
package to the module, and the facade would hand out the module instead of the function.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``exports``: submodule → its public names, space-separated. Returns the package's ``__getattr__``, ``__dir__``
    and ``__all__``."""
    home = {name: module for module, names in exports.items() for name in names.split()}
    clash = set(home) & set(exports)
    if clash:
        raise AssertionError(f"{package}: exported names equal to submodules: {sorted(clash)}")

    def __getattr__(name: str) -> object:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__, sorted(home)
