"""SDVG engine: speculative decoding for autoregressive video generation.

This package never imports ComfyUI. It is importable both as the top-level package ``sdvg`` (CLI, tests,
Python API) and as a subpackage of the ComfyUI node pack, so every internal import is relative.

Layout (docs/ARCHITECTURE.md): the foundation here (errors, blocks, devices, memory, jsonable); ``models`` (torch
modules, no file reading) ← ``loaders`` (files → models, the model bundle) ← ``sampling`` (the block loop) ←
``outputs``, ``eval``, ``cli``; beside them ``toy``, ``train``, ``bench`` and ``fixtures``. Each package's
``__init__`` is its facade: the names it offers, imported on first use.
"""

__version__ = "0.1.0"

from .errors import CancelledError, ConfigError, ModelFileError, NonFiniteError, RunFailed, SDVGError
from .facade import lazy_exports

__getattr__, __dir__, _lazy = lazy_exports(__name__, {
    "blocks": "FRAMES_PER_BLOCK LATENT_CHANNELS blocks_for_frames pixel_frames_for_blocks",
    "devices": "AUX_DTYPES DIT_DTYPES parse_dtype resolve_device set_cpu_threads",
    "jsonable": "json_float to_jsonable",
})
__all__ = ["__version__", "SDVGError", "ConfigError", "ModelFileError", "CancelledError", "NonFiniteError", "RunFailed",
           *_lazy]
