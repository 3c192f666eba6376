"""SDVGStartFrames: an IMAGE batch → SDVG_START, where the sampler starts from (given first blocks or v2v)."""

from __future__ import annotations

from comfy_api.latest import io

from .types import SDVG_START, SDVG_VAE

MODES = ["first blocks", "video-to-video"]


class SDVGStartFrames(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGStartFrames",
            display_name="SDVG Start Frames",
            category="SDVG/conditioning",
            description=(
                "Frames the sampler starts from, encoded here by the streaming VAE. first blocks: one image (held for "
                "block 0) or a clip's first 9 + 12k frames become the video's first blocks (image-to-video, "
                "extension; never drafted or scored). video-to-video: every block starts from the clip's latents "
                "noised to the strength (Krea)."
            ),
            inputs=[
                io.Image.Input("images", tooltip="An image or a clip [N, H, W, 3], the sampler's width × height (e.g. Load Video → Get Video Components)."),
                SDVG_VAE.Input("vae", tooltip="The streaming Wan 2.1 VAE (the sampler's)."),
                io.Combo.Input("mode", options=MODES, default=MODES[0], tooltip="first blocks: the frames are the video's first blocks, the sampler generates the rest (its blocks count them). video-to-video: the clip is re-generated at the strength; it must cover the sampler's blocks (12 × blocks − 3 frames)."),
                io.Float.Input("strength", default=0.6, min=0.0, max=1.0, step=0.05, tooltip="video-to-video only: 1 = text-to-video (the clip is ignored), 0 = the clip itself. Each block runs the steps of its schedule at or below 1000 × strength."),
            ],
            outputs=[SDVG_START.Output(display_name="start", tooltip="For the sampler's start input.")],
        )

    @classmethod
    def execute(cls, images, vae, mode: str, strength: float) -> io.NodeOutput:
        from ..sdvg import ConfigError
        from ..sdvg.sampling import InitBlocks, VideoToVideo

        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
        frames = images.float()
        if mode == MODES[0]:
            return io.NodeOutput(InitBlocks.from_frames(vae.model, frames))
        return io.NodeOutput(VideoToVideo.from_frames(vae.model, frames, strength))
