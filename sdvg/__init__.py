"""SDVG engine: speculative decoding for autoregressive video generation.

This package never imports ComfyUI. It is importable both as the top-level package ``sdvg`` (CLI, tests,
Python API) and as a subpackage of the ComfyUI node pack, so every internal import is relative.
"""

__version__ = "0.1.0"

from .errors import CancelledError, ConfigError, ModelFileError, SDVGError

__all__ = ["__version__", "SDVGError", "ConfigError", "ModelFileError", "CancelledError"]
