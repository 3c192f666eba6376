"""What travels on the SDVG sockets. Plain dataclasses (no ComfyUI import), immutable by convention:
a node that needs a variant builds a new one with ``dataclasses.replace`` and never edits its input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

OFFLOAD_POLICIES = ("keep_loaded", "offload_to_cpu_when_idle")


@dataclass(frozen=True)
class DiTHandle:
    """SDVG_DIT: a loaded causal Wan DiT. The sampler input it is wired to (drafter / target) gives its role.
    ``managed`` is how ComfyUI's memory manager knows it (``nodes/_models.py``)."""

    model: Any
    file: str
    dtype: str
    device: torch.device
    offload: str = "keep_loaded"
    managed: Any = None


@dataclass(frozen=True)
class AuxHandle:
    """SDVG_TEXT_ENCODER / SDVG_VAE / SDVG_REWARD: a loaded helper model and where it lives."""

    model: Any
    file: str
    device: torch.device
    kind: str
    managed: Any = None


@dataclass(frozen=True)
class SDVGConditioning:
    """SDVG_CONDITIONING: UMT5 embeddings ``[1, 512, text_dim]`` (padding zeroed) + the prompt text for the reward."""

    embeds: torch.Tensor
    prompt: str
    source: str = "sdvg"  # "sdvg" (our text encoder) or "comfy" (native CONDITIONING)
    extra: dict = field(default_factory=dict)
