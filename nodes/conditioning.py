"""SDVGTextEncode: a prompt → SDVG_CONDITIONING (UMT5 embeddings + the prompt text the reward model scores against);
SDVGPromptSchedule: a prompt timeline (prompts that start at given blocks) → SDVG_CONDITIONING."""

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
    from ..sdvg import ConfigError

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
        from ..sdvg import ConfigError
        from ..sdvg.sampling import check_prompt

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
        check_prompt(prompt, "SDVG Text Encode's prompt")  # an empty prompt would generate from no text, silently
        _models.use([text_encoder.managed])  # on its device through ComfyUI (which may evict it again later)
        embeds = text_encoder.model.encode(prompt)
        return io.NodeOutput(SDVGConditioning(embeds=embeds.detach(), prompt=prompt, source="sdvg"))


MAX_BLEND_BLOCKS = 64


def parse_schedule(schedule: str, blend_blocks: int):
    """The node's text (one ``BLOCK: prompt`` per line, or ``|``-separated) → an engine ``PromptSchedule``."""
    from ..sdvg.sampling import PromptSchedule

    lines = [ln.strip() for ln in schedule.replace("|", "\n").splitlines() if ln.strip()]
    return PromptSchedule.parse("|".join(lines), blend_blocks=int(blend_blocks))


class SDVGPromptSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGPromptSchedule",
            display_name="SDVG Prompt Schedule",
            category="SDVG/conditioning",
            description=(
                "A prompt timeline for the SDVG sampler: each line 'BLOCK: prompt' starts that prompt at that block "
                "(the first at 0). At a switch both DiTs' cross-attention is recomputed once; ImageReward scores each "
                "block against the prompt in force."
            ),
            inputs=[
                io.String.Input(
                    "schedule", multiline=True, default="0: a red fox trots through fresh snow\n4: the fox leaps over a frozen stream",
                    tooltip="One 'BLOCK: prompt' per line (or separated by |); blocks increase and the first is 0. A block is 3 latent frames = 12 pixel frames (0.75 s at 16 fps).",
                ),
                SDVG_TEXT_ENCODER.Input("text_encoder", tooltip="SDVG UMT5 text encoder: every prompt is encoded once, here."),
                io.Int.Input("blend_blocks", default=0, min=0, max=MAX_BLEND_BLOCKS, tooltip="Interpolate the text embeddings over this many blocks after each switch (Krea); 0 = switch at once. Each blend step costs one cross-attention setup per DiT."),
            ],
            outputs=[SDVG_CONDITIONING.Output(display_name="conditioning", tooltip="The prompt timeline for the SDVG sampler.")],
        )

    @classmethod
    def validate_inputs(cls, schedule: str, blend_blocks: int) -> bool | str:
        from ..sdvg import ConfigError

        try:
            parse_schedule(schedule, blend_blocks)
        except ConfigError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, schedule: str, text_encoder, blend_blocks: int = 0) -> io.NodeOutput:
        timeline = parse_schedule(schedule, blend_blocks)
        timeline.encode(lambda p: text_encoder.model.encode(p).detach())
        first = timeline.embeddings[0]
        return io.NodeOutput(SDVGConditioning(embeds=first, prompt=timeline.prompt_at(0), source="sdvg",
                                              schedule=timeline))
