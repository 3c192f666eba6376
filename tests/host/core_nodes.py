"""The ComfyUI core nodes our workflows may use, described in ``/object_info`` shape (only what the converter and
the widget checks read). ``tests/test_host_comfyui.py`` checks this table against a real host's ``/object_info``."""

from __future__ import annotations

# Frontend-only nodes: never sent to the server, skipped by the converter.
VIRTUAL_NODES = {"Note", "MarkdownNote"}


def _info(required: dict, optional: dict | None = None, output: list | None = None) -> dict:
    inputs = {"required": required}
    if optional:
        inputs["optional"] = optional
    return {
        "input": inputs,
        "input_order": {k: list(v) for k, v in inputs.items()},
        "output": output or [],
    }


CORE_NODES: dict[str, dict] = {
    "CreateVideo": _info(
        {"images": ["IMAGE", {}], "fps": ["FLOAT", {"default": 30.0, "min": 1.0, "max": 120.0, "step": 1.0}]},
        {"audio": ["AUDIO", {}]},
        ["VIDEO"],
    ),
    "SaveVideo": _info(
        {
            "video": ["VIDEO", {}],
            "filename_prefix": ["STRING", {"default": "video/ComfyUI"}],
            "format": ["COMBO", {"options": ["auto", "mp4"], "default": "auto"}],
            "codec": ["COMBO", {"options": ["auto", "h264"], "default": "auto"}],
        }
    ),
    "PreviewImage": _info({"images": ["IMAGE", {}]}),
    "PreviewAny": _info({"source": ["*", {}]}),
    "CLIPLoader": _info(
        {
            "clip_name": ["COMBO", {"options": []}],
            "type": ["COMBO", {"options": ["wan"]}],
        },
        {"device": ["COMBO", {"options": ["default", "cpu"]}]},
        ["CLIP"],
    ),
    "LoadVideo": _info({"file": ["COMBO", {"options": [], "video_upload": True}]}, output=["VIDEO"]),
    "GetVideoComponents": _info({"video": ["VIDEO", {}]}, output=["IMAGE", "AUDIO", "FLOAT"]),
    "CLIPTextEncode": _info({"text": ["STRING", {"multiline": True}], "clip": ["CLIP", {}]}, output=["CONDITIONING"]),
}
