"""SDVGTextEncode: a prompt → SDVG_CONDITIONING (UMT5 embeddings + the prompt text the reward model scores against)."""

from __future__ import annotations

import torch
from comfy_api.latest import io

from . import _models
from .handles import SDVGConditioning
from .types import SDVG_CONDITIONING, SDVG_TEXT_ENCODER

TEXT_TOKENS = 512  # Wan's UMT5 context length; the DiTs were trained on 512 tokens with padding zeroed


def embeds_from_native(conditioning) -> torch.Tensor:
    """ComfyUI CONDITIONING (``[[tensor [1, L, D], {...}], ...]``) → ``[1, 512, D]`` float32, zero padded.

    Only the first entry is used (SDVG has no CFG and no prompt mixing)."""
    from ..sdvg.errors import ConfigError

    try:
        cond = conditioning[0][0]
    except (TypeError, IndexError, KeyError) as exc:
        raise ConfigError("The CONDITIONING input is empty or not a ComfyUI conditioning list.") from exc
    if not isinstance(cond, torch.Tensor) or cond.ndim != 3:
        raise ConfigError(f"Expected a [1, tokens, dim] conditioning tensor, got {getattr(cond, 'shape', type(cond))}.")
    cond = cond[:1].detach().to(torch.float32)
    tokens = cond.shape[1]
    if tokens >= TEXT_TOKENS:
        return cond[:, :TEXT_TOKENS].clone()
    out = torch.zeros((1, TEXT_TOKENS, cond.shape[2]), dtype=torch.float32, device=cond.device)
    out[:, :tokens] = cond
    return out


class SDVGTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGTextEncode",
            display_name="SDVG Text Encode",
            category="SDVG/conditioning",
            description=(
                "Encodes the prompt for both DiTs and keeps its text for ImageReward. Either connect an SDVG text "
                "encoder, or a native CONDITIONING from CLIPTextEncode with a Wan UMT5 CLIP (then type the same prompt "
                "here: the reward model scores frames against this text)."
            ),
            inputs=[
                io.String.Input(
                    "prompt",
                    multiline=True,
                    default="",
                    tooltip="The video prompt. Also the text ImageReward scores every frame against (it reads the first 35 tokens).",
                ),
                SDVG_TEXT_ENCODER.Input(
                    "text_encoder", optional=True, tooltip="SDVG UMT5 text encoder. Leave empty when you connect a native CONDITIONING."
                ),
                io.Conditioning.Input(
                    "conditioning",
                    optional=True,
                    tooltip="Optional native CONDITIONING from CLIPTextEncode (CLIPLoader type 'wan'). Used instead of the SDVG text encoder.",
                ),
            ],
            outputs=[SDVG_CONDITIONING.Output(display_name="conditioning", tooltip="Embeddings + prompt text for the SDVG sampler.")],
        )

    @classmethod
    def execute(cls, prompt: str, text_encoder=None, conditioning=None) -> io.NodeOutput:
        from ..sdvg.errors import ConfigError

        if conditioning is not None:
            if not prompt.strip():
                raise ConfigError(
                    "With a native CONDITIONING the prompt text is still needed for ImageReward: type the same prompt "
                    "into SDVG Text Encode's prompt box."
                )
            return io.NodeOutput(SDVGConditioning(embeds=embeds_from_native(conditioning), prompt=prompt, source="comfy"))
        if text_encoder is None:
            raise ConfigError(
                "SDVG Text Encode needs a text encoder: connect SDVG Load UMT5 Text Encoder, or a CONDITIONING from "
                "CLIPTextEncode (with CLIPLoader type 'wan')."
            )
        _models.use([text_encoder.managed])  # on its device through ComfyUI (which may evict it again later)
        embeds = text_encoder.model.encode(prompt)
        return io.NodeOutput(SDVGConditioning(embeds=embeds.detach(), prompt=prompt, source="sdvg"))
