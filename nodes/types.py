"""The pack's socket types (ComfyUI V3 custom types)."""

from __future__ import annotations

from comfy_api.latest import io

SDVG_DIT = io.Custom("SDVG_DIT")
SDVG_TEXT_ENCODER = io.Custom("SDVG_TEXT_ENCODER")
SDVG_VAE = io.Custom("SDVG_VAE")
SDVG_REWARD = io.Custom("SDVG_REWARD")
SDVG_CONDITIONING = io.Custom("SDVG_CONDITIONING")
SDVG_ROUTER = io.Custom("SDVG_ROUTER")
SDVG_START = io.Custom("SDVG_START")
