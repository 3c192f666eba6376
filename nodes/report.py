"""SDVGReport: the sampler's JSON report → a readable summary and a timeline chart."""

from __future__ import annotations

import json

import numpy as np
import torch
from comfy_api.latest import io

from . import _host


def parse_report(text: str) -> dict:
    from ..sdvg import ConfigError

    try:
        report = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"The report input is not JSON ({exc}); connect the sampler's 'report' output.") from exc
    if not isinstance(report, dict) or "blocks" not in report:
        raise ConfigError("The report JSON has no 'blocks'; connect the sampler's 'report' output.")
    return report


def pil_to_image(img) -> torch.Tensor:
    arr = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).unsqueeze(0)


class SDVGReport(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SDVGReport",
            display_name="SDVG Report",
            category="SDVG/report",
            description="Turns the sampler's JSON report into a text summary and a timeline chart (q_b per block vs τ, draft accepted vs target).",
            inputs=[
                io.String.Input("report", force_input=True, tooltip="The 'report' output of SDVG Speculative Sampler."),
                io.Int.Input("chart_width", default=900, min=320, max=4096, step=4, tooltip="Width of the timeline chart in pixels."),
                io.Int.Input("chart_height", default=300, min=160, max=2048, step=4, tooltip="Height of the timeline chart in pixels."),
            ],
            outputs=[
                io.String.Output(display_name="summary", tooltip="Human-readable summary: acceptance, speed-up estimate, per-block decisions."),
                io.Image.Output(display_name="timeline", tooltip="Timeline chart as an IMAGE (connect PreviewImage or SaveImage)."),
            ],
        )

    @classmethod
    def execute(cls, report: str, chart_width: int, chart_height: int) -> io.NodeOutput:
        from ..sdvg.outputs import render_timeline, summarize

        data = parse_report(report)
        chart = render_timeline(data, width=int(chart_width), height=int(chart_height))
        image = pil_to_image(chart).to(_host.intermediate_device())
        return io.NodeOutput(summarize(data), image)
