"""ComfyUI V3 adapters for the SDVG engine.

Only ``comfy_entrypoint`` is exported (never ``NODE_CLASS_MAPPINGS`` as well: ComfyUI would ignore the
entrypoint). ComfyUI's own modules are imported lazily, inside ``node_classes``, so importing this package
outside ComfyUI (tests, CLI) never touches the host.
"""

from __future__ import annotations


def node_classes() -> list[type]:
    """The V3 node classes of this pack (imports ``comfy_api``; call only inside ComfyUI or with a stub)."""
    from .conditioning import SDVGPromptSchedule, SDVGTextEncode
    from .core_model import SDVGDiTFromModel
    from .loaders import SDVGModelLoader, SDVGRewardLoader, SDVGTextEncoderLoader, SDVGVAELoader
    from .lora import SDVGLoraLoader
    from .report import SDVGReport
    from .router import SDVGRewardRouter
    from .sampler import SDVGSpeculativeSampler
    from .start_frames import SDVGStartFrames

    return [
        SDVGModelLoader,
        SDVGLoraLoader,
        SDVGTextEncoderLoader,
        SDVGVAELoader,
        SDVGRewardLoader,
        SDVGDiTFromModel,
        SDVGTextEncode,
        SDVGPromptSchedule,
        SDVGStartFrames,
        SDVGRewardRouter,
        SDVGSpeculativeSampler,
        SDVGReport,
    ]


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    from ._host import register_toy_models
    from .routes import register

    classes = node_classes()
    register()
    register_toy_models()

    class SDVGExtension(ComfyExtension):
        async def get_node_list(self) -> list[type]:
            return classes

    return SDVGExtension()
