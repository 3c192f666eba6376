"""SDVGLoraLoader: one more LoRA on an SDVG DiT (chainable), merged into the weights when the DiT is loaded."""

from __future__ import annotations

from comfy_api.latest import io

from . import _host
from .handles import DiTHandle
from .loaders import model_file_problem
from .types import SDVG_DIT

LORA_FOLDER = "loras"


class SDVGLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGLoraLoader",
            display_name="SDVG Load LoRA",
            category="SDVG/loaders",
            description=(
                "Adds a Wan 2.1 LoRA (ComfyUI/kohya, VideoX-Fun, LyCORIS naming, diffusers/PEFT, original-key or "
                "DiffSynth files, .diff / .diff_m deltas too) to an SDVG DiT. Chain several; each adds strength × its "
                "delta. The LoRAs are merged into the weights as the DiT file is read (full precision, before any fp8 "
                "conversion), so no second copy of the model is kept. Keys for parts a text-to-video DiT lacks (an I2V "
                "LoRA's image layers, text-encoder keys) are skipped with a warning unless strict is on."
            ),
            inputs=[
                SDVG_DIT.Input("dit", tooltip="An SDVG DiT from SDVG Load Video DiT (or another SDVG Load LoRA)."),
                io.Combo.Input("lora_name", options=_host.list_model_files(LORA_FOLDER),
                               tooltip="A LoRA file from the ComfyUI 'loras' model folder."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                               tooltip="How much of the LoRA to add (0 = none: the DiT is returned unchanged)."),
                io.Boolean.Input("strict", default=False, optional=True,
                                 tooltip="Refuse a LoRA with I2V or text-encoder keys instead of skipping those keys "
                                         "with a warning (the rest still applies when off)."),
            ],
            outputs=[SDVG_DIT.Output(display_name="dit", tooltip="The DiT with this LoRA added.")],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str) -> bool | str:
        return model_file_problem(LORA_FOLDER, lora_name)

    @classmethod
    def execute(cls, dit: DiTHandle, lora_name: str, strength: float, strict: bool = False) -> io.NodeOutput:
        from ..sdvg import ConfigError
        from ..sdvg.loaders import LoraSpec, inspect_dit_checkpoint, read_lora
        from ..sdvg.models import dit_param_shapes

        if dit.lora_base is None:
            raise ConfigError(
                f"SDVG Load LoRA cannot add a LoRA to {dit.file}: it came from a core MODEL. Put the LoRA on the MODEL "
                "instead (LoraLoaderModelOnly before SDVG DiT from MODEL)."
            )
        if float(strength) == 0.0:
            return io.NodeOutput(dit)
        path = _host.full_model_path(LORA_FOLDER, lora_name)
        # checked against the DiT's shapes now (headers only), so a wrong LoRA fails on this node, not at the run
        config = inspect_dit_checkpoint(dit.lora_base).config
        read_lora(LoraSpec(path, float(strength), strict=bool(strict)), dit_param_shapes(config), what=dit.file)
        return io.NodeOutput(dit.with_lora(path, float(strength)))
