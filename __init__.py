"""ComfyUI entry point of the SDVG node pack.

ComfyUI imports this file by path under a mangled module name; everything below uses relative imports.
The engine lives in ``sdvg/`` (no ComfyUI imports); ``nodes/`` holds the thin V3 adapters.
"""

from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
