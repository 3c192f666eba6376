"""SDVGDiTFromModel: a core ComfyUI ``MODEL`` holding a Wan 2.1 T2V DiT → an SDVG causal DiT (drafter or target).

Lets users keep their own loaders and LoRA chains: *Load Diffusion Model* → *LoraLoaderModelOnly* → this node. The
weights, with the MODEL's weight patches applied by ComfyUI itself, are copied one tensor at a time into SDVG's
causal DiT on the chosen device; the core MODEL keeps its own copy (ComfyUI's, in RAM until something samples with
it). A GGUF MODEL (ComfyUI-GGUF's loader) keeps its quantized weights and a scaled-fp8 MODEL its fp8 + scale, as
SDVG's own loader does with those files. Not carried over: patches that change the forward instead of the weights
(attention overrides, model wrappers, hooks, sampling shift) and scheduled hook LoRAs.
"""

from __future__ import annotations

import math

from comfy_api.latest import io

from ..sdvg import DIT_DTYPES
from . import _host, _models
from .handles import OFFLOAD_POLICIES, DiTHandle
from .types import SDVG_DIT


class SDVGDiTFromModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGDiTFromModel",
            display_name="SDVG DiT from MODEL",
            category="SDVG/loaders",
            description=(
                "Turns a core MODEL that holds a Wan 2.1 text-to-video DiT (Load Diffusion Model, optionally through "
                "LoRA loaders) into an SDVG DiT for the sampler's drafter or target input. Weight patches such as "
                "LoRAs are applied; forward patches (attention overrides, wrappers, hooks) are not."
            ),
            inputs=[
                io.Model.Input("model", tooltip="A core MODEL with a Wan 2.1 T2V DiT (1.3B or 14B shape, or a causal "
                                                "Self-Forcing / Krea Realtime file loaded by Load Diffusion Model)."),
                io.Combo.Input("weight_dtype", options=list(DIT_DTYPES), default="auto",
                               tooltip="Precision of SDVG's copy. auto = the MODEL's bf16/fp16 on GPU, fp32 on CPU. "
                                       "fp8_e4m3fn stores 8-bit weights and computes in bf16."),
                io.Combo.Input("device", options=_host.device_options(), default="auto",
                               tooltip="Where SDVG's copy runs. auto = cuda:0 when present."),
                io.Combo.Input("offload", options=list(OFFLOAD_POLICIES), default="keep_loaded",
                               tooltip="keep_loaded: stay on the device between runs. offload_to_cpu_when_idle: "
                                       "move to CPU RAM after each run."),
            ],
            outputs=[SDVG_DIT.Output(display_name="dit", tooltip="The causal DiT; connect to the sampler's drafter or target.")],
        )

    @classmethod
    def execute(cls, model, weight_dtype: str, device: str, offload: str) -> io.NodeOutput:
        from ..sdvg import resolve_device
        from ..sdvg.loaders import dit_from_weights

        core = _host.core_wan_weights(model)
        dev = resolve_device(device, what="DiT")
        nbytes = core.quantized_bytes or sum(math.prod(s) for s in core.shapes.values()) * core.stored_dtype.itemsize

        def load():
            return dit_from_weights(core.read, core.shapes, heads=core.heads, stored_dtype=core.stored_dtype,
                                    dtype=weight_dtype, device=dev, name="the core MODEL",
                                    quantized_bytes=core.quantized_bytes)

        managed = _models.load("dit", ("core", *core.identity, weight_dtype, str(dev)), "MODEL", nbytes, dev, load)
        return io.NodeOutput(DiTHandle.of(managed, file="MODEL", dtype=weight_dtype, device=dev, offload=offload))
